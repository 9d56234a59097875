"""Write a tokenizer that covers a model's whole vocabulary into its folder.

A checkpoint served with ``load_format=dummy`` (random weights, e.g. Qwen3-30B-A3B's config)
samples any id below ``vocab_size``; the server detokenizes each one, so the tokenizer must know
them all. This one is a word-level tokenizer with one word per id (``t0`` .. ``tN``): real
tokenization and detokenization work per token, none of it model-specific.

    python3 tests/gpu/vocab_tokenizer.py MODEL_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def write(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    size = int(cfg["vocab_size"])
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    eos = cfg.get("eos_token_id", size - 1)
    eos = eos[0] if isinstance(eos, list) else eos
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"t{eos}", unk_token="t0")
    fast.save_pretrained(model_dir)
    return size


if __name__ == "__main__":
    print("tokenizer of", write(Path(sys.argv[1])), "ids in", sys.argv[1])
