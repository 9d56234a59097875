"""``routereplay bench trainer`` runs end to end on a small shape (real redis-server)."""

from __future__ import annotations

from routereplay.bench.trainer import main


def test_bench_trainer_small(redis_url, capsys):
    argv = ["--tokens", "4096", "--layers", "4", "--experts", "64", "--topk", "4"]
    assert (
        main(
            [
                *argv,
                "--prompt-len",
                "64",
                "--completion-len",
                "256",
                "--repeat",
                "1",
                "--redis-url",
                redis_url,
                "--json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "END TO END per step" in out and '"end_to_end_tokens_per_s"' in out
