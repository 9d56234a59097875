"""Print one line per rank from replay_check.py logs: the ``RESULT {json}`` records.

Ranks share stdout, so records can be glued together on one line; they are found by decoding
JSON after each ``RESULT `` marker rather than line by line.
"""

from __future__ import annotations

import json
import sys

KEYS = (
    "r2",
    "short_target_raises",
    "refused",
    "stale_instances_before_build",
    "vpp_requires_chunk",
    "refused_targets",
    "nograd_forward_in_step_raises",
    "replay_path",
    "bypass_detected",
    "policy",
    "repacked_decisions",
    "own_vs_free_forward",
)


def results(text: str) -> list[dict]:
    dec = json.JSONDecoder()
    out = []
    i = text.find("RESULT {")
    while i >= 0:
        r, end = dec.raw_decode(text, i + 7)
        out.append(r)
        i = text.find("RESULT {", end)
    return sorted(out, key=lambda r: r["rank"])


def main() -> int:
    for r in results(sys.stdin.read()):
        rows = {k: (v["fwd"], v["rec"], v["bad"]) for k, v in r["router_rows"].items()}
        if r["args"].get("policy", "none") == "own_routing":  # + own rows, recompute checks
            own = ("own", "rec_differs", "rec_own_topk_moved")
            rows = {k: (*rows[k], *(v[x] for x in own)) for k, v in r["router_rows"].items()}
        extra = {k: r[k] for k in KEYS if k in r}
        print(
            f"   rank {r['rank']} mcore {r['megatron']} ok {r['ok']} "
            f"targets==truth {r['targets_equal_truth']} layers {r['router_layer_numbers']} "
            f"chunks {r['router_chunks']} rows(fwd,rec,bad) {rows} fillers {r['filler_rows']} "
            f"expert_mismatch {r['expert_count_mismatches']} {extra if extra else ''}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
