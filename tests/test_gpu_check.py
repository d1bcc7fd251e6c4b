"""The GPU check's parts at toy sizes on the CPU (``benchmarks/gpu_check.sh --cpu-dry-run`` runs
them all; CI runs that): ``benchmarks/bench_peers.py``'s resident-slice counts, clipped run, planner
predictions, traced step and per-slice exactness, and the per-stream table of a trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

from offload.kernels import host_kernel

from .test_scripts import ROOT, run

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import bench_peers
    import gpu_check_summary
    import stream_idle
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def test_peers_benchmark_runs_counts_clipping_predictions_a_trace_and_compares_every_slice(tmp_path):
    pytest.importorskip("transformers")
    runs = ["resident", "offload", "offload-in-backward-resident2", "offload-clip", "offload-in-backward"]
    run("benchmarks/bench_peers.py", "--cpu-dry-run", "--deterministic", "--predict", "--trace", str(tmp_path),
        "--trace-runs", "offload-clip", "--only", ",".join(runs), "--json", str(tmp_path / "peers.json"))
    report = json.loads((tmp_path / "peers.json").read_text())
    assert list(report["runs"]) == runs, report["failed"]
    offload, ours, clipped = (report["runs"][n] for n in runs[1:4])
    # Two of the 4 slices resident whatever --resident-slices says: less crosses the link.
    assert ours["resident_slices"] == 2 and report["resident_slices"] == 1
    assert 0 < ours["loaded_bytes_per_step"] < offload["loaded_bytes_per_step"]
    assert [where for where, _ in ours["slice_parameters_sha256_16"]] == ["device", "device", "host", "host"]
    assert clipped["median_clip_s"] > 0
    # The planner beside each offloaded run, with the run's own schedule and resident slices.
    assert "planner" not in report["runs"]["resident"]
    for run_report, schedule, count in ((offload, "overlapped", 0), (ours, "in-backward", 2), (clipped, "overlapped", 0)):
        planner = run_report["planner"]
        assert (planner["schedule"], planner["resident_slices"]) == (schedule, count)
        assert planner["from_resident"]["step"] > 0 and planner["from_ops"]["step"] > 0
    assert report["planner_rates"]["host_to_device"] == report["bandwidth_bytes_per_s"]["host_to_device"]
    assert report["planner_rates"]["host_memory_bandwidth"] == report["host_bandwidth"]["bytes_per_s"]
    # Each offloaded run's bound counts the host's bytes (benchmarks/host_bound.py) beside the old one.
    for run_report in (offload, ours, clipped):
        assert run_report["bound"]["old_efficiency"] == run_report["efficiency"]
        # The host's rate: the larger of the copy's and the fused AdamW alone's, both measured here.
        rates = run_report["bound"]["host_bytes_per_s"]
        assert rates["copy"] == report["host_bandwidth"]["bytes_per_s"] and rates["fused_adamw"] > 0
        assert run_report["bound"]["bound_terms"]["host_bytes_s"] == pytest.approx(
            run_report["bound"]["host_bytes"]["total"] / max(rates.values()))
        # bf16 compute: the shadow written by the one-pass update where its kernel ran, else its own pass.
        assert report["one_pass"] == (host_kernel(wait=True) is not None)
        assert (run_report["bound"]["host_bytes"]["shadow"] == 0) == report["one_pass"]
    # Every variant's gradients after the first backward are the resident model's, bit for bit.
    per_variant = report["gradients_after_first_backward"]["per_variant"]
    assert set(per_variant) == set(runs[1:]) and all(v["bit_identical"] for v in per_variant.values())
    # The traced run (one step longer) and the clipped one are left out of the per-slice comparison,
    # and the resident variant places two slices' updates on the device: offload and
    # offload-in-backward, every update on the host, are compared slice by slice.
    assert report["parameters_per_slice"] == {"groups_compared": 4, "groups_differing": 0, "all_equal": True,
                                              "differing": {}}
    streams = clipped["streams"]
    assert streams["trace"] == "trace-offload-clip.json.gz" and streams["window_ms"] > 0
    assert streams["lanes"] == "host threads" and all(r["busy_ms"] > 0 for r in streams["per_lane"].values())
    with gzip.open(tmp_path / "trace-offload-clip.json.gz", "rt") as f:
        assert any(e.get("name") == "forward+backward" for e in json.load(f)["traceEvents"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peers.json", "trace-offload-clip.json.gz"]


def test_per_slice_exactness_reports_a_slice_whose_digests_differ():
    report = {"runs": {
        "offload": {"slice_parameters_sha256_16": [["host", "a"], ["host", "b"]]},
        "offload-resident": {"slice_parameters_sha256_16": [["device", "c"], ["host", "x"]]},
        "offload-in-backward": {"slice_parameters_sha256_16": [["host", "a"], ["host", "y"]]},
        "offload-in-backward-resident": {"slice_parameters_sha256_16": [["device", "c"], ["host", "x"]]},
        "offload-clip": {"slice_parameters_sha256_16": [["host", "z"], ["host", "z"]]},  # trains differently
    }}
    verdict = bench_peers.exactness(report)
    # Compared within a placement: slice 0's update on the device changes what slice 1 sees later.
    assert verdict["groups_compared"] == 4 and not verdict["all_equal"]
    assert verdict["differing"] == {"slice 1 on the host (every update on the host)": {"offload": "b",
                                                                                         "offload-in-backward": "y"}}


def test_resident_counts_in_run_names_are_parsed_and_checked():
    assert bench_peers.split_variant("offload-in-backward-resident6") == ("offload-in-backward-resident", 6)
    assert bench_peers.split_variant("offload-resident") == ("offload-resident", None)
    assert bench_peers.split_variant("offload") == ("offload", None)
    with pytest.raises(SystemExit):
        bench_peers.parse_args(["--cpu-dry-run", "--only", "offload-resident9"])  # 4 slices at toy sizes
    with pytest.raises(SystemExit):
        bench_peers.parse_args(["--cpu-dry-run", "--only", "offload-clip7x"])


def test_stream_table_counts_busy_idle_and_gaps_inside_the_forward_and_backward():
    def kernel(ts: float, dur: float, stream: int) -> dict:
        return {"ph": "X", "cat": "kernel", "name": f"k{stream}", "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = [{"ph": "X", "cat": "user_annotation", "name": "forward+backward", "ts": 1000.0, "dur": 1000.0},
              kernel(900, 200, 7),   # half inside the window
              kernel(1150, 100, 7),  # overlaps the next: counted once
              kernel(1200, 100, 7),
              kernel(1500, 400, 7),  # a 200 us gap before it
              kernel(1000, 50, 21),
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1100.0, "dur": 300.0, "args": {"stream": 21}},
              kernel(2500, 100, 21)]  # after the window
    table = stream_idle.lanes(events)
    assert table["lanes"] == "cuda streams" and table["window_ms"] == 1.0
    compute, copies = table["per_lane"]["stream 7"], table["per_lane"]["stream 21"]
    assert compute["busy_ms"] == pytest.approx(0.1 + 0.15 + 0.4) and compute["idle_ms"] == pytest.approx(0.35)
    assert compute["gaps_over_0.1ms"] == 1 and compute["longest_gap_ms"] == pytest.approx(0.2)
    assert copies["busy_ms"] == pytest.approx(0.35) and copies["copies_ms"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="forward\\+backward"):
        stream_idle.lanes(events[1:])


def test_host_pauses_are_the_stretches_between_a_threads_innermost_events_and_name_what_ended_before():
    def op(tid: int, name: str, ts: float, dur: float, cat: str = "cpu_op") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [{"ph": "X", "cat": "user_annotation", "name": "forward+backward", "ts": 0.0, "dur": 20000.0, "tid": 1},
              op(2, "outer", 0, 3000), op(2, "a", 100, 200), op(2, "b", 2800, 100),  # 2.5 ms inside "outer"
              op(2, "c", 3000, 100), op(2, "d", 9100, 100),  # 6 ms
              op(2, "e", 9300, 500),  # 0.1 ms: not a pause
              op(3, "wait", 2000, 250, "cuda_runtime"), op(3, "wait", 2950, 100, "cuda_runtime"),
              op(4, "mm", 0, 100, "kernel")]  # a device event: not a host thread's
    table = stream_idle.lanes(events)["host_pauses"]
    assert set(table) == {"thread 1", "thread 2", "thread 3"}
    two = table["thread 2"]
    assert two["pauses_over_1ms"] == 2 and two["paused_ms"] == pytest.approx(2.5 + 6.0)
    assert two["longest_pause_ms"] == pytest.approx(6.0)
    # The 6 ms pause began 0.05 ms after thread 3's second wait ended; nothing ended in the 1 ms before the first.
    assert two["most_begin_after"] == "thread 3 wait (1)"
    assert table["thread 3"]["pauses_over_1ms"] == 0 and table["thread 3"]["most_begin_after"] == ""


def test_the_h200_trace_shows_the_backward_thread_paused_in_every_slice_and_the_resident_one_not():
    """The committed traces of 2026-11-28 (benchmarks/results/h200-2026-11-28/): what the docs say of
    them (docs/performance.md, the H200's results)."""
    folder = ROOT / "benchmarks" / "results" / "h200-2026-11-28"
    offloaded = stream_idle.lanes(stream_idle.load(str(folder / "trace-offload-in-backward.json.gz")))["host_pauses"]
    resident = stream_idle.lanes(stream_idle.load(str(folder / "trace-resident.json.gz")))["host_pauses"]
    backward = max(offloaded.values(), key=lambda row: row["events"])
    assert backward["pauses_over_1ms"] == 18 and round(backward["paused_ms"]) == 224
    assert backward["most_begin_after"].endswith("cudaStreamIsCapturing (16)")
    assert max(resident.values(), key=lambda row: row["events"])["pauses_over_1ms"] == 0


def test_the_summary_reads_the_boundaries_stage_as_bench_boundaries_writes_it(tmp_path):
    run("benchmarks/bench_boundaries.py", "--layers", "2", "--hidden", "32", "--seq-len", "8", "--rounds", "2",
        "--warmup", "0", "--json", str(tmp_path / "boundaries.json"))
    line = gpu_check_summary.boundaries(json.loads((tmp_path / "boundaries.json").read_text()))
    assert line.startswith("boundaries:") and "same loss and gradients: True" in line and "offloads 5 / 7" in line


def test_the_summary_reads_the_walk_stage_as_bench_walk_writes_it(tmp_path):
    run("benchmarks/bench_walk.py", "--layers", "2", "--hidden", "32", "--seq-len", "8", "--rounds", "1",
        "--warmup", "0", "--json", str(tmp_path / "walk.json"))
    report = json.loads((tmp_path / "walk.json").read_text())
    line = gpu_check_summary.walk(report)
    assert line.startswith("walk: 4 thin slices on cpu") and "checkpointed" in line
    assert report["same_loss"] is True and report["library_calls"]["forward"] > 0


def test_the_gpu_check_lists_only_test_files_that_exist_and_brings_back_at_most_8_files():
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    assert "tests/test_trainers_cuda.py" in script and (ROOT / "tests" / "test_trainers_cuda.py").exists()
    # What the device tool returns: run.log, stages.log, pytest.log, summary.json and at most two traces.
    written = {name for name in ("run.log", "stages.log", "pytest.log", "summary.json") if f'$OUT/{name}' in script}
    assert len(written) == 4 and script.count('--trace "$OUT"') == 2  # the slices stage's trace, the trace stage's two
