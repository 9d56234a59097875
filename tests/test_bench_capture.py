"""``routereplay bench capture``: every choice stored by each server row, the figures printed."""

from __future__ import annotations

from routereplay.bench.capture import main


def test_every_row_stores_every_choice(capsys) -> None:
    argv = ["--groups", "2", "--group-size", "4", "--prompt-tokens", "1024",
            "--completion-tokens", "256", "--in-flight", "4", "--workers", "1",
            "--weights"]  # fmt: skip
    assert main(argv) == 0
    rows = {ln[:28].strip(): ln[28:].split() for ln in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"floor: no routes", "peer: inline .npy base64",
                         "routereplay, threads", "routereplay, 1 processes"}  # fmt: skip
    assert all(r[0] == "8/8" for r in rows.values()), rows
    # With a worker process the store's CPU is the worker's (0.4 s here), none with threads.
    assert float(rows["routereplay, 1 processes"][3]) > 0
    assert float(rows["routereplay, threads"][3]) == 0
