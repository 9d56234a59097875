"""docs/trainer-hf.md's packed transformers step, run as written against a real service: routes
the engine chose for completions made with the openai SDK, fetched over HTTP and replayed into
the served checkpoint loaded by transformers, forward and backward."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from openai import OpenAI

pytest.importorskip("transformers")
pytestmark = pytest.mark.vllm

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer-hf.md"


def _example() -> str:
    section = DOC.read_text().split("# Hugging Face transformers trainers", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_docs_packed_step_runs(service) -> None:
    llm = OpenAI(base_url=service.v1, api_key="-")
    resp = llm.completions.create(
        model=service.model, prompt="a GRPO group prompt", n=2, max_tokens=8, seed=3
    )
    ids = [c.model_extra["routed_experts"]["route_id"] for c in resp.choices]
    ids.append(llm.completions.create(model=service.model, prompt="one more", max_tokens=5)
               .choices[0].model_extra["routed_experts"]["route_id"])  # fmt: skip
    scope: dict = {}
    exec(compile(_example(), str(DOC), "exec"), scope)
    loss = scope["packed_step"](str(service.model_path), service.url, ids)
    assert math.isfinite(loss) and loss > 0
