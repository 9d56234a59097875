"""Reference run: vLLM's offline ``LLM.generate`` on given token prompts; routes saved to .npz.

    python _offline_generate.py MODEL IN.json OUT.npz

IN.json: list of {"prompt_token_ids", "seed", "temperature", "max_tokens", "n"}. OUT.npz has,
per request i and choice j, ``tokens_{i}_{j}`` (int64 output ids) and ``routes_{i}_{j}`` (the raw
``routed_experts`` array). Runs in its own process so its engine does not share the service's.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> None:
    model, inp, out = sys.argv[1:4]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    reqs = json.loads(open(inp).read())
    llm = LLM(
        model=model, dtype="float32", max_model_len=2048, enforce_eager=True, seed=0,
        gpu_memory_utilization=0.5, enable_return_routed_experts=True, enable_prefix_caching=True,
    )  # fmt: skip
    arrays: dict[str, np.ndarray] = {}
    for i, r in enumerate(reqs):
        sp = SamplingParams(
            n=r["n"], seed=r["seed"], temperature=r["temperature"], max_tokens=r["max_tokens"],
            ignore_eos=True,
        )  # fmt: skip
        (res,) = llm.generate([TokensPrompt(prompt_token_ids=r["prompt_token_ids"])], sp)
        for o in res.outputs:
            arrays[f"tokens_{i}_{o.index}"] = np.asarray(o.token_ids, dtype=np.int64)
            arrays[f"routes_{i}_{o.index}"] = np.asarray(o.routed_experts)
    np.savez(out, **arrays)


if __name__ == "__main__":
    main()
