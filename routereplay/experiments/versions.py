"""``routereplay experiment versions``: the routing of two weight versions of one model, side by
side, in a ``routereplay report`` page.

Serves checkpoint A (``routereplay serve``, a private Redis, an admin key, the checkpoints'
parent as ``--weights-root``) labelled ``--label-a``, samples completions of prompts cut from the
Python standard library's sources, loads checkpoint B in place (``/reload_weights``, labelled
``--label-b``), samples again, and writes the report of both versions' stored routes (with
``--png-dir``, its figures as PNG files too; ``--trainer-log`` adds a trainer's replay scalars).
A and B must have the same shape, as for any weight update.

    routereplay experiment versions --model-a .device/serve/trained-init --label-a init \\
        --model-b .device/serve/trained --label-b step-2000 --out routing.html --png-dir docs/
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

__all__ = ["main", "prompts"]


def prompts(n: int, chars: int = 300) -> list[str]:
    """``n`` prompts: consecutive ``chars``-character pieces of the standard library's sources."""
    text = "".join(f.read_text(errors="ignore") for f in sorted(
        Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py")))  # fmt: skip
    return [text[i * chars : (i + 1) * chars] for i in range(n)]


@contextlib.contextmanager
def _service(args: argparse.Namespace, redis_url: str, root: Path, log: Path) -> Iterator[str]:
    from routereplay.bench.servers import engine_env, server_process
    from routereplay.local_redis import free_port

    port = free_port()
    argv = [sys.executable, "-m", "routereplay.cli", "serve", "--port", str(port),
            "--model", str(args.model_a), "--served-model-name", "m", "--redis-url", redis_url,
            "--log-level", "warning", "--admin-keys", f"report:{args.admin_key}",
            "--weights-root", str(root)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with server_process(argv, f"{url}/ready", log, engine_env(), 300):
        yield url


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import httpx

    from routereplay import report
    from routereplay.local_redis import redis_server

    p = argparse.ArgumentParser(prog="routereplay experiment versions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model-a", type=Path, required=True)
    p.add_argument("--label-a", default="a")
    p.add_argument("--model-b", type=Path, required=True)
    p.add_argument("--label-b", default="b")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--admin-key", default="versions-admin-key-0000")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--png-dir", type=Path)
    p.add_argument("--trainer-log", type=Path, help="passed on to routereplay report")
    args = p.parse_args(argv)
    root = Path(os.path.commonpath([args.model_a.resolve(), args.model_b.resolve()]))
    auth = {"Authorization": f"Bearer {args.admin_key}"}
    with (
        tempfile.TemporaryDirectory(prefix="rr-versions-") as d,
        redis_server() as redis_url,
        _service(args, redis_url, root, Path(d) / "serve.log") as url,
        httpx.Client(base_url=url, headers=auth, timeout=600) as http,
    ):
        for label, load in ((args.label_a, None), (args.label_b, args.model_b)):
            if load is None:
                r = http.post("/update_weight_version", json={"new_version": label})
            else:
                r = http.post("/reload_weights", json={"weights_path": str(load.resolve()),
                                                       "weight_version": label})  # fmt: skip
            r.raise_for_status()
            for i, prompt in enumerate(prompts(args.prompts)):
                body = {"model": "m", "prompt": prompt, "max_tokens": args.max_tokens,
                        "temperature": 1.0, "seed": i}  # fmt: skip
                http.post("/v1/completions", json=body).raise_for_status()
            print(f"{label}: {args.prompts} completions", flush=True)
        # The admin key's tenant ("report") keeps its routes under <route-prefix>:t:report.
        argv_r = ["--redis-url", redis_url, "--prefix", "rr:t:report",
                  "--weight-version", args.label_a, "--weight-version",
                  args.label_b, "--out", str(args.out),
                  "--title", f"routing of {args.model_b.name}: {args.label_a} and {args.label_b}",
                  ]  # fmt: skip
        if args.png_dir:
            argv_r += ["--png-dir", str(args.png_dir)]
        if args.trainer_log:
            argv_r += ["--trainer-log", str(args.trainer_log)]
        return report.main(argv_r)


if __name__ == "__main__":
    sys.exit(main())
