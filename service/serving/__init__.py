"""Serving classes: what each API does, apart from the routers that expose it over HTTP."""

from .completions import ServingChat, ServingCompletion
from .models import ServingModels
from .rl import ServingRL
from .routes import ServingRoutes

__all__ = ["ServingChat", "ServingCompletion", "ServingModels", "ServingRL", "ServingRoutes"]
