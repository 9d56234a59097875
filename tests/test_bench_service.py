"""``routereplay bench service``'s parts that need no engine: the GRPO workload, the streamed
chunk reader (its fast path must read what a JSON parse reads), the row comparison, the peer's
route check and the report's ratios. The servers themselves run in the benchmark."""

from __future__ import annotations

import base64
import io
import json
import os
import signal

import numpy as np
import pytest

from routereplay.bench import service, service_report
from routereplay.bench.serving_load import Choice, Group, LevelLoad, _StreamState, make_groups
from routereplay.bench.serving_probe import check_inline, compare_rows
from routereplay.client import RouteRecord


def test_groups_are_seeded_and_within_their_spans() -> None:
    a = make_groups(50, 8, "512-2048", "256-1024", 151_936, seed=3)
    assert a == make_groups(50, 8, "512-2048", "256-1024", 151_936, seed=3)
    assert a != make_groups(50, 8, "512-2048", "256-1024", 151_936, seed=4)
    assert all(512 <= len(g.prompt) <= 2048 and 256 <= g.max_tokens <= 1024 for g in a)
    assert all(g.n == 8 and 3 <= min(g.prompt) and max(g.prompt) < 151_936 for g in a)
    assert len({len(g.prompt) for g in a}) > 10  # lengths drawn, not fixed
    fixed = make_groups(3, 1, "64", "32", 100, seed=0)
    assert [(len(g.prompt), g.max_tokens) for g in fixed] == [(64, 32)] * 3


def _sse(obj: dict, compact: bool) -> bytes:
    sep = (",", ":") if compact else (", ", ": ")
    return b"data: " + json.dumps(obj, separators=sep).encode()


@pytest.mark.parametrize("compact", [True, False])
def test_stream_reader_fast_path_reads_what_a_parse_reads(compact: bool) -> None:
    g = Group(0, [5, 6, 7], 2, 3, 0)
    lines = [{"choices": [{"index": 0, "text": "", "finish_reason": None, "token_ids": None,
                           "prompt_token_ids": [5, 6, 7]}]}]  # fmt: skip
    for t in range(3):
        for i in range(2):
            fin = "length" if t == 2 else None
            c = {"index": i, "text": "x", "finish_reason": fin, "token_ids": [100 * i + t]}
            if fin:
                c["routed_experts"] = {"route_id": f"r-{i}", "status": "stored"}
            lines.append({"choices": [c]})
    lines.append({"choices": [], "usage": {"completion_tokens": 6}})
    st, lv = _StreamState(g), LevelLoad(1, True)
    for k, obj in enumerate(lines):
        st.chunk(_sse(obj, compact), float(k), lv)
    assert st.prompt == [5, 6, 7]
    assert st.tokens == {0: [0, 1, 2], 1: [100, 101, 102]}
    assert st.routes == {0: {"route_id": "r-0", "status": "stored"},
                         1: {"route_id": "r-1", "status": "stored"}}  # fmt: skip
    assert lv.completion_tokens == 6
    assert st.first == 0.0
    # Choice 0 chunks at 0, 1, 3, 5; choice 1 at 2, 4, 6.
    assert sorted(lv.itl) == [1.0, 2.0, 2.0, 2.0, 2.0]


def test_stream_reader_raises_on_an_error_event() -> None:
    st, lv = _StreamState(Group(0, [1], 1, 1, 0)), LevelLoad(1, True)
    with pytest.raises(RuntimeError, match="boom"):
        st.chunk(_sse({"error": {"message": "boom"}}, True), 0.0, lv)


def _record(tokens: list[int], experts: np.ndarray) -> RouteRecord:
    valid = np.ones(len(tokens), bool)
    valid[-1] = False
    experts = experts.copy()
    experts[-1] = 0
    return RouteRecord(token_ids=np.asarray(tokens), experts=experts, valid=valid,
                       moe_layers=(0, 1), num_layers=2, num_experts=16, prompt_len=2)  # fmt: skip


def _experts(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows_ = [[rng.permutation(16)[:4] for _ in range(2)] for _ in range(rows)]
    return np.stack(rows_).astype(np.uint8)


def test_compare_rows_stops_at_the_first_different_token() -> None:
    tokens = [1, 2, 3, 4, 5, 6]
    e = _experts(6, 0)
    rec = _record(tokens, e)
    ref = e[:, :, ::-1].copy()  # the same sets in another slot order
    assert compare_rows(rec, ref, tokens, 0) == (10, 10)  # 5 valid rows x 2 layers
    ref[1, 0] = (ref[1, 0] + 1) % 16
    assert compare_rows(rec, ref, tokens, 0) == (9, 10)
    assert compare_rows(rec, ref, tokens, 2) == (6, 6)
    # The sequences part at token 3: rows 0-2 saw the same tokens.
    assert compare_rows(rec, e, [1, 2, 3, 9, 9, 9], 0) == (6, 6)
    assert compare_rows(rec, e, [7], 0) == (0, 0)


def _b64(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a)
    return base64.b64encode(buf.getvalue()).decode()


def test_the_peer_check_counts_missing_and_misshapen_routes() -> None:
    ok = Choice(0, 0, [1, 2], [3, 4], _b64(np.zeros((3, 2, 4), np.int32)))
    short = Choice(0, 1, [1, 2], [3, 4], _b64(np.zeros((2, 2, 4), np.int32)))
    missing = Choice(1, 0, [1, 2], [3, 4], None)
    t = check_inline([ok, short, missing], layers=2, top_k=4)
    assert (t.choices, t.present, t.verified, t.lost, t.wrong) == (3, 2, 1, 1, 1)
    assert "shape (2, 2, 4)" in t.first_problem


def test_vllm_flags_from_the_shared_engine_settings() -> None:
    cfg = {"dtype": "bfloat16", "enforce_eager": False, "enable_prefix_caching": True,
           "load_format": "dummy", "max_num_seqs": 256}  # fmt: skip
    argv = service._vllm_argv(cfg, "/m", 8000, peer=True)
    assert "--enable-return-routed-experts" in argv
    assert "--enforce-eager" not in argv and "--enable-prefix-caching" in argv
    assert argv[argv.index("--load-format") + 1] == "dummy"
    assert "--enable-return-routed-experts" not in service._vllm_argv(cfg, "/m", 8000, False)
    assert "--disable-log-stats" not in argv  # vLLM's stats logged, as routereplay's engine does
    rr = service._rr_argv({**cfg, "max_model_len": 4096, "seed": 0,
                           "gpu_memory_utilization": 0.8}, "/m", 1, "redis://x")  # fmt: skip
    rest = json.loads(rr[rr.index("--engine-args") + 1])
    assert rest == {"load_format": "dummy", "max_num_seqs": 256}  # the service sets the rest
    assert "--no-enforce-eager" in rr


def test_vllms_own_server_parses_the_peers_flags() -> None:
    """What the bench passes ``vllm serve``'s entry point is flags of the installed vLLM: its
    stats logged, every kernel compile logged, the routes returned."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cfg = {"dtype": "float32", "max_model_len": 512, "seed": 0, "gpu_memory_utilization": 0.5,
           "max_num_seqs": 8, "enforce_eager": True, "enable_prefix_caching": True,
           **service._jit_log()}  # fmt: skip
    argv = service._vllm_argv(cfg, "/m", 8000, peer=True)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert parsed.jit_monitor_verbose and not parsed.disable_log_stats
    assert parsed.enable_return_routed_experts and parsed.max_num_seqs == 8


def test_log_count_reads_only_what_a_level_appended(tmp_path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"JIT compilation during inference: a\nother\n")
    start = log.stat().st_size
    with open(log, "ab") as f:
        f.write(b"x JIT compilation during inference: b\nnone\nJIT compilation during inference\n")
    assert service._log_count(log, start, service._JIT_LINE) == 2
    assert service._log_count(log, 0, service._JIT_LINE) == 3


def _row(server: str, mode: str, conc: int, tok_s: float, ttft: float | None) -> dict:
    return {"server": server, "mode": mode, "concurrency": conc, "sequences": conc,
            "wall_s": 10.0, "tok_s": tok_s, "e2e_p50": 1.0, "e2e_p99": 2.0, "ttft_p50": ttft,
            "ttft_p99": ttft, "itl_p50": 0.01, "itl_p99": 0.02, "cpu_api_us_tok": 50.0,
            "cpu_all_us_tok": 900.0, "errors": 0, "first_error": ""}  # fmt: skip


def test_report_prints_ratios_to_the_floor_and_the_peer(tmp_path) -> None:
    (tmp_path / "floor.json").write_text(json.dumps([_row("floor", "stream", 32, 1000, 0.2)]))
    (tmp_path / "peer.json").write_text(json.dumps([_row("peer", "json", 32, 800, None)]))
    rr = [_row("routereplay", "stream", 32, 990, 0.21), _row("routereplay", "json", 32, 1000, None)]
    rr[1]["routes"] = {"choices": 32, "present": 32, "verified": 32, "lost": 0, "wrong": 0,
                       "first_problem": ""}  # fmt: skip
    (tmp_path / "routereplay.json").write_text(json.dumps(rr))
    args = {"model": "m", "group_size": 8, "prompt_tokens": "1", "max_tokens": "1", "dtype": "x"}
    text = service_report.report(tmp_path, args)
    lines = text.splitlines()
    # tok/s and TTFT p50: the ratio of medians, then the worst run's; one run each here.
    assert any(ln.split()[:7] == ["floor", "stream", "32", "0.990", "0.990", "1.050", "1.050"]
               for ln in lines)  # fmt: skip
    assert any(ln.split()[:5] == ["peer", "json", "32", "1.250", "1.250"] for ln in lines)
    assert any("32/32" in ln and ln.startswith("routereplay  json") for ln in lines)
    assert not any(ln.startswith("medians") for ln in lines)  # one run: no spread to give


def test_report_gives_medians_spread_and_the_worst_run(tmp_path) -> None:
    floor = [_row("floor", "stream", 256, t, f) for t, f in ((1000, 0.5), (1100, 0.6), (900, 0.4))]
    rr = [_row("routereplay", "stream", 256, t, f)
          for t, f in ((980, 0.55), (1040, 0.9), (1010, 0.5))]  # fmt: skip
    for i, r in enumerate(floor + rr):
        r["run"] = i % 3 + 1
    (tmp_path / "floor.json").write_text(json.dumps(floor))
    (tmp_path / "routereplay.json").write_text(json.dumps(rr))
    args = {"model": "m", "group_size": 8, "prompt_tokens": "1", "max_tokens": "1", "dtype": "x"}
    lines = service_report.report(tmp_path, args).splitlines()
    med = next(ln for ln in lines if ln.startswith("routereplay ") and "[" in ln)
    assert med.split()[:7] == ["routereplay", "stream", "256", "3", "1010", "[980-1040]", "550"]
    after = lines[next(i for i, ln in enumerate(lines) if ln.startswith("routereplay over")) :]
    ratio = next(ln.split() for ln in after if ln.startswith("floor "))
    # Within each run: tok/s 0.980, 0.945, 1.122 (median 0.980, worst 0.945); TTFT p50 1.100,
    # 1.500, 1.250 (median 1.250, worst 1.500).
    assert ratio[3:7] == ["0.980", "0.945", "1.250", "1.500"]
    assert [ln.split()[4] for ln in lines if ln.startswith("routereplay  stream")] == [
        "1", "2", "3"]  # fmt: skip


def test_report_gives_the_engine_tpot_and_how_much_longer_a_slot_is_held(tmp_path) -> None:
    """held = the client's mean request time less vLLM's mean end-to-end time; routereplay's
    over the peer's within each run, in ms and as a share of routereplay's request time."""
    peer = [_row("peer", "json", 128, 4000, None) for _ in range(3)]
    rr = [_row("routereplay", "json", 128, 3990, None) for _ in range(3)]
    # (client mean, engine mean, TPOT) by run: peer held 10, 12, 11 ms; routereplay 40, 22, 61.
    figures = {"peer": [(10.010, 10.0, 0.030), (12.012, 12.0, 0.031), (11.011, 11.0, 0.030)],
               "routereplay": [(10.040, 10.0, 0.0303), (12.022, 12.0, 0.0306),
                               (11.061, 11.0, 0.0300)]}  # fmt: skip
    for rows in (peer, rr):
        for run, r in enumerate(rows, 1):
            r["run"], (r["e2e_mean"], r["engine_e2e_mean"], r["engine_tpot_mean"]) = (
                run,
                figures[r["server"]][run - 1],
            )
            r["held_mean"] = service._held(r)
    (tmp_path / "peer.json").write_text(json.dumps(peer))
    (tmp_path / "routereplay.json").write_text(json.dumps(rr))
    args = {"model": "m", "group_size": 8, "prompt_tokens": "1", "max_tokens": "1", "dtype": "x"}
    lines = service_report.report(tmp_path, args).splitlines()
    after = lines[next(i for i, ln in enumerate(lines) if ln.startswith("routereplay over")) :]
    cols = next(ln for ln in after if ln.startswith("peer ")).split()
    # TPOT within runs: 1.010, 0.987, 1.000 (median 1.000, worst 1.010); held longer: 30, 10
    # and 50 ms (median 30 ms), 0.30%, 0.08%, 0.45% of routereplay's request time.
    assert cols[-5:] == ["1.000", "1.010", "+30.0", "ms", "(+0.30%)"]
    row = next(ln for ln in lines if ln.startswith("routereplay  json") and " 3 " in ln)
    assert "30000" in row.split() and "61.0" in row.split()  # TPOT in us, held in ms
    assert service._held({"e2e_mean": None, "engine_e2e_mean": 1.0}) is None
    assert service._held({"e2e_mean": 1.0}) is None  # a server without vLLM's stats


def test_histogram_summary_reads_the_observations_between_two_reads() -> None:
    from routereplay.bench.serving_probe import histogram_summary

    before = {"sum": 1.0, "count": 10, "le=0.01": 8, "le=0.1": 10, "le=+Inf": 10}
    after = {"sum": 3.0, "count": 110, "le=0.01": 60, "le=0.1": 109, "le=+Inf": 110}
    s = histogram_summary(before, after)
    assert s["n"] == 100 and abs(s["mean_s"] - 0.02) < 1e-12
    assert s["p99_le_s"] == 0.1  # 99 of the 100 new ones are at most 0.1 s
    assert s["max_le_s"] == float("inf")  # one of them is beyond 0.1 s
    assert histogram_summary(after, after) == {}
    later = {**after, "sum": 3.5, "count": 120, "le=0.01": 70, "le=0.1": 119, "le=+Inf": 120}
    assert histogram_summary(after, later)["max_le_s"] == 0.01  # all ten new ones


def test_histogram_total_sums_every_series_and_only_its_own() -> None:
    from routereplay.bench.serving_probe import histogram_total

    page = """vllm:ttft_seconds_sum{engine="0",model_name="m"} 1.5
vllm:ttft_seconds_count{engine="0",model_name="m"} 3.0
vllm:ttft_seconds_sum{engine="1",model_name="m"} 0.5
vllm:ttft_seconds_count{engine="1",model_name="m"} 1.0
vllm:ttft_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:ttft_seconds_sum_extra 99.0
vllm:ttft_seconds_created{engine="0",model_name="m"} 1.7e9
"""
    assert histogram_total("vllm:ttft_seconds", page) == {"sum": 2.0, "count": 4.0}
    assert histogram_total("vllm:absent", page) == {"sum": 0.0, "count": 0.0}
    before = "vllm:ttft_seconds_sum 0.5\nvllm:ttft_seconds_count 1\n"
    assert service._engine_means(before, page)["engine_ttft_mean"] is None  # another name
    means = service._engine_means(page.replace("ttft_seconds", "time_to_first_token_seconds"),
                                  page.replace("ttft_seconds", "time_to_first_token_seconds")
                                  .replace("1.5", "3.5").replace("3.0", "5.0"))  # fmt: skip
    assert means["engine_ttft_mean"] == 1.0  # 2 s more over 2 more requests


def test_histogram_and_gauge_read_one_series_of_a_metrics_page() -> None:
    """The series of a labelled histogram that ``labels`` names, not its neighbours."""
    import http.server
    import threading

    from routereplay.bench.serving_probe import gauge, histogram

    page = b"""# TYPE p histogram
p_bucket{generation="0",le="0.5"} 7.0
p_bucket{generation="0",le="+Inf"} 9.0
p_count{generation="0"} 9.0
p_sum{generation="0"} 4.0
p_bucket{generation="2",le="0.5"} 1.0
p_bucket{generation="2",le="+Inf"} 2.0
p_count{generation="2"} 2.0
p_sum{generation="2"} 1.25
frozen 695000.0
"""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/metrics"
        assert histogram(url, "p", 'generation="2"') == {
            "le=0.5": 1.0, "le=+Inf": 2.0, "count": 2.0, "sum": 1.25}  # fmt: skip
        assert histogram(url, "p", 'generation="0"')["count"] == 9.0
        assert histogram(url, "p") == {}  # no unlabelled series
        assert gauge(url, "frozen") == 695000.0 and gauge(url, "absent") is None
    finally:
        srv.shutdown()


def test_py_spy_samples_every_process_of_the_server_group(tmp_path) -> None:
    """``--py-spy``: each process of the server's group gets its own raw profile, and the
    busiest frame of a spinning engine-like child is its spin function."""
    import subprocess
    import sys
    import time

    from routereplay.bench import pyspy
    from routereplay.bench.serving_probe import group_pids

    script = tmp_path / "server.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "def spin_in_child(marker):\n"
        "    open(marker, 'w').close()\n"
        "    while True:\n"
        "        sum(range(1000))\n"
        "if sys.argv[1] == 'child':\n"
        "    spin_in_child(sys.argv[2])\n"
        "subprocess.Popen([sys.executable, __file__, 'child', sys.argv[1]])\n"
        "time.sleep(60)\n"
    )
    spinning = tmp_path / "spinning"  # the child writes it once inside its spin function
    server = subprocess.Popen([sys.executable, str(script), str(spinning)], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not spinning.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = group_pids(server.pid)
        assert server.pid in pids and len(pids) == 2
        with pyspy.recording(pids, tmp_path / "prof", "server-json-c1") as files:
            time.sleep(1.5)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert sorted(f.name.split("-")[3] for f in files) == sorted(str(p) for p in pids)
    child = next(f for f in files if f.name.split("-")[3] != str(server.pid))
    frame, share = pyspy.top_frames(child, 1)[0]
    assert frame.startswith("spin_in_child") and share > 0.5
    assert pyspy.shares(child, ["spin_in_child", "no_such_frame"]) == {
        "spin_in_child": pytest.approx(1.0), "no_such_frame": 0.0}  # fmt: skip
    assert pyspy.main([str(child), "--frame", "spin_in_child"]) == 0
    parent = next(f for f in files if f.name.split("-")[3] == str(server.pid))
    inclusive = dict(pyspy.top_frames(parent, 5, leaf=False))
    assert any(f.startswith("<module>") for f in inclusive)


def test_py_spy_seconds_samples_only_the_start_of_a_level(tmp_path) -> None:
    """``--py-spy-seconds 1``: py-spy stops by itself after the level's first second and
    writes its profile while the level goes on."""
    import subprocess
    import sys
    import time

    from routereplay.bench import pyspy

    spin = subprocess.Popen([sys.executable, "-c", "while True: sum(range(1000))"])
    try:
        with pyspy.recording([spin.pid], tmp_path, "lvl", seconds=1) as files:
            deadline = time.monotonic() + 60
            while not _written(files[0]) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert files[0].stat().st_size > 0  # written before the block ends
            samples = sum(int(ln.rsplit(" ", 1)[1]) for ln in files[0].read_text().splitlines())
            assert 20 <= samples <= 150  # about one second at 100 Hz, not the whole block
    finally:
        spin.kill()
        spin.wait()


def _written(f) -> bool:
    return f.exists() and f.stat().st_size > 0
