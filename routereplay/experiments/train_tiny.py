"""Train a small Qwen3-MoE briefly, so its routing is learned rather than random.

``prepare``: tokenize text that ships with Python (the standard library's sources) with the tiny
model's tokenizer into a token file. ``train`` (on a GPU; CPU works, slowly): a Qwen3-MoE of the
tiny model's tokenizer and a small shape, built in Megatron-Core with ``bridge``, trained on that
token stream (next-token loss plus a load-balancing loss), exported as a Hugging Face checkpoint
(``config.json`` + ``weights.pt``; ``finish`` turns it into a directory vLLM serves).

    python -m routereplay.experiments.train_tiny prepare --out corpus.npy
    python -m routereplay.experiments.train_tiny train --corpus corpus.npy --out DIR --steps 1500
    python -m routereplay.experiments.train_tiny finish --weights DIR --out MODEL_DIR
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

__all__ = ["CONFIG", "main"]

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
    corpus: Path, out: Path, steps: int, batch: int, seq: int, lr: float, device: str
) -> None:
    import torch

    from . import bridge

    dev = torch.device(device)
    bridge.init_megatron(dev, seed=0)
    model = bridge.build_model(
        CONFIG, device=dev, routing_replay=False,
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
        if step % 100 == 0 or step == steps - 1:
            log.append(
                {"step": step, "loss": round(float(loss), 4), "s": round(time.time() - t0, 1)}
            )
            print(json.dumps(log[-1]), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    # bf16 on the way back (half the bytes; the device tool returns files up to 16 MiB);
    # ``finish`` writes them as float32, exactly.
    state = {k: v.to(torch.bfloat16) for k, v in bridge.export_hf_weights(model, CONFIG).items()}
    torch.save(state, out / "weights.pt")
    (out / "config.json").write_text(json.dumps(CONFIG, indent=1))
    (out / "train_log.json").write_text(json.dumps(log, indent=1))


def finish(weights: Path, out: Path) -> None:
    """A checkpoint directory vLLM serves: the config, safetensors weights, the tokenizer."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from routereplay.service.tiny_model import ensure_tiny_model

    tiny = ensure_tiny_model("moe")
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    shutil.copy2(weights / "config.json", out / "config.json")
    state = torch.load(weights / "weights.pt", map_location="cpu")
    save_file({k: v.float().contiguous() for k, v in state.items()}, out / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    print(out)


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
    c = sub.add_parser("finish")
    c.add_argument("--weights", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.out)
    elif args.cmd == "train":
        train(args.corpus, args.out, args.steps, args.batch, args.seq, args.lr, args.device)
    else:
        finish(args.weights, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
