"""Build the tiny deterministic Qwen3-MoE model (and tokenizer) of the embedded default.

No weights can be downloaded on the machines this runs on, so ``routereplay serve`` without a
model builds one: a 4-layer Qwen3-MoE (8 experts, top-2) in float32 with a byte-level BPE
tokenizer and a chat template. Everything is seeded, so two builds are byte-identical and tests
are reproducible. The ``dense-first`` variant has ``mlp_only_layers=[0]`` (a dense first layer,
as DeepSeek-V3 and friends have), to exercise dense-layer handling.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

__all__ = ["VARIANTS", "build_tiny_model", "default_model_dir", "ensure_tiny_model"]

# name -> config overrides; "moe" is the default served model.
VARIANTS: dict[str, dict] = {
    "moe": {},
    "dense-first": {"mlp_only_layers": [0]},
    "sharp": {},
}
# name -> weight init (std per kind, RMSNorm weights); the others use _INIT_DEFAULT.
# "sharp" is a model whose layers matter: unit norms, a sharper output layer and a router at a
# scale where bf16 flips some decisions, so a train/inference routing mismatch moves logprobs
# (with every weight at std 0.05 the output is nearly uniform and no mismatch can show).
_INIT_DEFAULT = {"router": 0.5, "lm_head": 0.05, "other": 0.05, "norm": None}
_INIT = {"sharp": {"router": 0.1, "lm_head": 0.2, "other": 0.05, "norm": 1.0}}

_SEED = 1234
_VOCAB = 1024
_BUILD_VERSION = 1  # bump when the recipe changes, so caches rebuild

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def default_model_dir() -> Path:
    """``$ROUTEREPLAY_MODEL_DIR`` or ``~/.cache/routereplay/models``."""
    env = os.environ.get("ROUTEREPLAY_MODEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "routereplay" / "models"


def _corpus(n_lines: int = 4000) -> list[str]:
    rng = random.Random(_SEED)
    words = [
        "route",
        "expert",
        "token",
        "layer",
        "model",
        "replay",
        "train",
        "gradient",
        "policy",
        "reward",
        "sample",
        "prefix",
        "cache",
        "batch",
        "engine",
        "request",
        "the",
        "a",
        "of",
        "and",
        "to",
        "in",
        "is",
        "for",
        "on",
        "with",
        "user",
        "assistant",
        "system",
        "hello",
        "world",
        "mixture",
        "router",
        "top",
        "k",
        "value",
        "key",
        "query",
        "attention",
        "hidden",
    ]
    lines = []
    for _ in range(n_lines):
        n = rng.randint(3, 16)
        s = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            s += f" {rng.randint(0, 99999)}."
        lines.append(s.capitalize())
    return lines


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB - 16,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out)


def build_tiny_model(out: Path, variant: str = "moe") -> Path:
    """Write config, float32 safetensors weights and tokenizer of ``variant`` into ``out``."""
    import torch
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    if variant not in VARIANTS:
        raise ValueError(
            f"unknown tiny model variant {variant!r}; expected one of {list(VARIANTS)}"
        )
    out.mkdir(parents=True, exist_ok=True)
    _build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    cfg = Qwen3MoeConfig(
        vocab_size=_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
        **VARIANTS[variant],
    )
    torch.manual_seed(_SEED)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(_SEED + 1)
    init = _INIT.get(variant, _INIT_DEFAULT)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if init["norm"] is not None and name.endswith("norm.weight"):
                p.fill_(init["norm"])
                continue
            # A wide router init gives decisive (non-uniform) routing, so ties are rare and
            # bit-exact comparisons between engines are meaningful.
            if name.endswith("mlp.gate.weight"):
                std = init["router"]
            elif name == "lm_head.weight":
                std = init["lm_head"]
            else:
                std = init["other"]
            p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    (out / "routereplay_build.json").write_text(
        json.dumps({"variant": variant, "seed": _SEED, "build_version": _BUILD_VERSION})
    )
    return out


def ensure_tiny_model(variant: str = "moe", root: Path | None = None) -> Path:
    """Path of the cached tiny model ``variant``, building it atomically if it is missing."""
    root = root or default_model_dir()
    target = root / f"tiny-qwen3-moe-{variant}-v{_BUILD_VERSION}"
    if (target / "routereplay_build.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Build aside and rename: concurrent builders (two test sessions) never see a half model.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by users of the host
    build_tiny_model(tmp, variant)
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "routereplay_build.json").is_file():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target
