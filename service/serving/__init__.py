"""Serving classes: what each API does, apart from the routers that expose it over HTTP."""

from .completions import ServingChat, ServingCompletion
from .models import ServingModels
from .routes import ServingRoutes

__all__ = ["ServingChat", "ServingCompletion", "ServingModels", "ServingRoutes"]
