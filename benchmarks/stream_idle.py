"""Per-stream busy and idle time of one profiled step, read from a ``torch.profiler`` Chrome trace.

The window is the step's ``forward+backward`` range (``benchmarks/bench_peers.py`` labels it with
``record_function``; it ends after a device synchronize, so the device's work of the range lies in
it). Per lane (a CUDA stream; on a CPU-only trace, a host thread): the time some kernel, copy or
memset ran (the union of their intervals, clipped to the window), the idle rest, the count of
gaps over 0.1 ms and the longest, and the kernels with the most time. Two runs' tables set side
by side (the resident model's and an offloaded one's) say where an offloaded forward and backward
spends the time by which it exceeds the resident one: more kernel time on the compute stream
(recompute, casts) or the compute stream idle (waiting for loads).

Usage::

    python benchmarks/stream_idle.py trace-resident.json.gz trace-offload-in-backward.json.gz
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from typing import Any

WINDOW = "forward+backward"
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_US = 100.0


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Covered length and the gaps between covered stretches (not before the first or after the last)."""
    covered, gaps, end = 0.0, [], None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            covered += stop - start
            end = stop
        elif stop > end:
            covered += stop - end
            end = stop
    return covered, gaps


def lanes(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The table for one trace: window length and, per lane, busy, idle, gaps and top kernels (ms)."""
    windows = [e for e in events if e.get("name") == WINDOW and e.get("cat") == "user_annotation"]
    if not windows:
        raise ValueError(f"no {WINDOW!r} range in the trace: profile a step of benchmarks/bench_peers.py")
    start = windows[-1]["ts"]
    stop = start + windows[-1]["dur"]
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e and e["ts"] < stop and e["ts"] + e["dur"] > start]
    device = [e for e in timed if e.get("cat") in DEVICE_KINDS]
    on_device = bool(device)
    chosen = device if on_device else [e for e in timed if e.get("cat") == "cpu_op"]
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in chosen:
        key = f"stream {e.get('args', {}).get('stream', '?')}" if on_device else f"thread {e.get('tid')}"
        grouped[key].append(e)
    table = {}
    for key, items in sorted(grouped.items()):
        busy, gaps = _union([(max(e["ts"], start), min(e["ts"] + e["dur"], stop)) for e in items])
        by_name: dict[str, float] = defaultdict(float)
        for e in items:
            by_name[e["name"][:80]] += e["dur"]
        table[key] = {"busy_ms": busy / 1e3, "idle_ms": (stop - start - busy) / 1e3, "events": len(items),
                      "gaps_over_0.1ms": sum(g > GAP_US for g in gaps), "longest_gap_ms": max(gaps, default=0) / 1e3,
                      "copies_ms": sum(e["dur"] for e in items if e.get("cat") == "gpu_memcpy") / 1e3,
                      "top": {n: t / 1e3 for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:8]}}
    return {"window_ms": (stop - start) / 1e3, "lanes": "cuda streams" if on_device else "host threads",
            "per_lane": table}


def markdown(tables: dict[str, dict[str, Any]]) -> str:
    """One row per run and lane: window, busy, idle, gaps."""
    lines = ["| run | lane | window ms | busy ms | idle ms | copies ms | gaps > 0.1 ms | longest gap ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for run, t in tables.items():
        for lane, row in t["per_lane"].items():
            lines.append(f"| {run} | {lane} | {t['window_ms']:.1f} | {row['busy_ms']:.1f} | {row['idle_ms']:.1f} "
                         f"| {row['copies_ms']:.1f} | {row['gaps_over_0.1ms']} | {row['longest_gap_ms']:.2f} |")
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    tables = {path: lanes(load(path)) for path in paths}
    print(markdown(tables))
    print(json.dumps(tables, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
