"""Per-stream busy and idle time of one profiled step, read from a ``torch.profiler`` Chrome trace.

The window is the step's ``forward+backward`` range (``benchmarks/bench_peers.py`` labels it with
``record_function``; it ends after a device synchronize, so the device's work of the range lies in
it). Per lane (a CUDA stream; on a CPU-only trace, a host thread): the time some kernel, copy or
memset ran (the union of their intervals, clipped to the window), the idle rest, the count of
gaps over 0.1 ms and the longest, and the kernels with the most time. Two runs' tables set side
by side (the resident model's and an offloaded one's) say where an offloaded forward and backward
spends the time by which it exceeds the resident one: more kernel time on the compute stream
(recompute, casts) or the compute stream idle (waiting for loads).

Per host thread too, its pauses: stretches over 1 ms in which none of its innermost recorded
events (operators, CUDA calls, ranges) ran. The thread was then running Python between
operators, waiting for Python's lock held by another thread, or inside a call nothing records
(the main thread while the autograd engine's device thread runs the backward; the update worker
inside the host kernel or waiting for its next slice). In the H200's trace of 2026-11-28
(``benchmarks/results/h200-2026-11-28/``) the backward's thread paused 18 times, 224 ms of a 434 ms
backward, 10-20 ms in every slice. 16 of the pauses began within 1 ms of the update worker's last
CUDA call before a slice's update (its wait for the slice's gradients): the worker then ran the
one-pass kernel, which held the lock while it ran (it lets go since). The resident trace's
backward thread has none.

Usage::

    python benchmarks/stream_idle.py trace-resident.json.gz trace-offload-in-backward.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from typing import Any

WINDOW = "forward+backward"
DEVICE_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
GAP_US = 100.0
PAUSE_US = 1000.0
HOST_KINDS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")


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
            "per_lane": table, "host_pauses": host_pauses(timed, start, stop)}


def host_pauses(timed: list[dict[str, Any]], start: float, stop: float) -> dict[str, Any]:
    """Per host thread with events in the window: the stretches over :data:`PAUSE_US` between the end
    of one innermost event (one that holds no other of the thread's) and the start of the next,
    and the other thread's event that most often ended in the :data:`PAUSE_US` before one began."""
    threads: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in timed:
        if e.get("cat") in HOST_KINDS:
            threads[f"thread {e.get('tid')}"].append(e)
    innermost = {}
    for key, items in threads.items():
        items.sort(key=lambda e: (e["ts"], -e["dur"]))
        innermost[key] = [e for e, after in zip(items, items[1:] + [None])
                          if after is None or after["ts"] >= e["ts"] + e["dur"]]
    table = {}
    for key, events in sorted(innermost.items()):
        pauses = [(max(a["ts"] + a["dur"], start), min(b["ts"], stop)) for a, b in zip(events, events[1:])]
        pauses = [(s, e) for s, e in pauses if e - s > PAUSE_US]
        before: dict[str, int] = defaultdict(int)
        for begin, _ in pauses:
            ended = [(e["ts"] + e["dur"], f"{other} {e['name'][:60]}") for other, others in innermost.items()
                     if other != key for e in others if begin - PAUSE_US <= e["ts"] + e["dur"] <= begin]
            if ended:
                before[max(ended)[1]] += 1
        after, count = max(before.items(), key=lambda kv: kv[1], default=("", 0))
        table[key] = {"events": len(threads[key]), "pauses_over_1ms": len(pauses),
                      "paused_ms": sum(e - s for s, e in pauses) / 1e3,
                      "longest_pause_ms": max((e - s for s, e in pauses), default=0.0) / 1e3,
                      "most_begin_after": f"{after} ({count})" if count else ""}
    return table


def markdown(tables: dict[str, dict[str, Any]]) -> str:
    """One row per run and lane: window, busy, idle, gaps."""
    lines = ["| run | lane | window ms | busy ms | idle ms | copies ms | gaps > 0.1 ms | longest gap ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for run, t in tables.items():
        for lane, row in t["per_lane"].items():
            lines.append(f"| {run} | {lane} | {t['window_ms']:.1f} | {row['busy_ms']:.1f} | {row['idle_ms']:.1f} "
                         f"| {row['copies_ms']:.1f} | {row['gaps_over_0.1ms']} | {row['longest_gap_ms']:.2f} |")
    lines += ["", "| run | host thread | events | pauses > 1 ms | paused ms | longest pause ms | most begin after |",
              "|---|---|---:|---:|---:|---:|---|"]
    for run, t in tables.items():
        for thread, row in t.get("host_pauses", {}).items():
            lines.append(f"| {run} | {thread} | {row['events']} | {row['pauses_over_1ms']} | {row['paused_ms']:.1f} "
                         f"| {row['longest_pause_ms']:.2f} | {row['most_begin_after']} |")
    return "\n".join(lines)


def main(paths: list[str]) -> None:
    tables = {path: lanes(load(path)) for path in paths}
    print(markdown(tables))
    print(json.dumps(tables, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="torch.profiler Chrome traces (.json or .json.gz), one table column each")
    main(parser.parse_args().traces)
