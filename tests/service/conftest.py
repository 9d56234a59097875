"""Fixtures the real-engine modules share over the run's shared service (tests/engines.py)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from engines import Service


@pytest.fixture()
def client(service: Service) -> Iterator[openai.OpenAI]:
    """The official openai SDK pointed at the shared service, without retries."""
    with openai.OpenAI(base_url=service.v1, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(service: Service):  # type: ignore[no-untyped-def]
    """The tiny model's tokenizer, as transformers loads it (vLLM's tests count with it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(service.model_path)
