"""The order the host update worker runs the slices' updates in: the next forward's (slice 0 first,
the default) against the order their gradients landed (first in, first out: the last slice first),
for the schedule where they differ, ``update_in_backward=True`` (Note: [Updates in the next
forward's order] in ``offload/optimizing/stepping.py``).

It is ``benchmarks/bench_schedule.py`` (same arguments, same CPU stand-in, same JSON) with two
schedules timed per round, in rotated order within one process so that the machine's drifting load
falls on both alike:

- ``backward``: ``OffloadOptimizer(update_in_backward=True)`` as the library builds it;
- ``backward+landed-order``: the same, its update worker switched to first in, first out (the
  order before: backward queues slice N-1's update first and slice 0's last).

Where the update outlasts backward, the worker still holds updates when the next forward starts;
that forward loads slice 0 first, which the old order updated last. Besides the step times, the JSON
gets, per schedule, what the forwards spent waiting for updates (``forward_wait``: the median over
the timed steps of the whole forward's waits, and of its wait for slice 0's update): on a shared
machine the steps move by tens of percent from one to the next, and those waits are where the order
shows.

Usage::

    python benchmarks/bench_update_order.py --update-sleep-ns 5 --threads 1 --dim 1024 --slices 8 \
        --ratios 2 4 --steps 6 --rounds 3 --resident --json benchmarks/results/update_order_cpu.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_schedule  # noqa: E402
from bench_schedule import Schedule  # noqa: E402

from offload.model import engine_of  # noqa: E402

LANDED = "backward+landed-order"
_new_optimizer = bench_schedule.new_optimizer
#: Schedule name -> per forward, each wait for an update: [(slice, seconds), ...] (all runs, all steps).
WAITS: dict[str, list[list[tuple[int, float]]]] = {}


def new_optimizer(args: Any, model: Any, schedule: Schedule) -> Any:
    """``bench_schedule``'s optimizer; for :data:`LANDED`, with its update worker first in, first out.
    Each forward's waits for updates are timed into :data:`WAITS`."""
    optimizer = _new_optimizer(args, model, schedule)
    if schedule.name == LANDED:
        optimizer._updates.start_worker()
        optimizer._updates.worker.by_key = False
    updates = engine_of(model).updates
    wait, forwards = updates.wait, WAITS.setdefault(schedule.name, [])
    begin = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        forwards.append([])
        return begin(*args, **kwargs)

    def timed(index: int) -> None:
        start = time.perf_counter()
        try:
            wait(index)
        finally:
            if forwards:
                forwards[-1].append((index, time.perf_counter() - start))

    model.forward, updates.wait = forward, timed
    return optimizer


def add_waits(path: str, args: Any) -> None:
    """Put each schedule's forward waits into the JSON ``bench_schedule`` wrote: medians over the
    timed forwards (after the warm-up; each run's own), in ms. One entry for all ratios: the
    script is meant for one ratio at a time."""
    per_run = args.warmup + args.steps + 1
    with open(path) as f:
        report = json.load(f)
    summary = {}
    for name in ("backward", LANDED):  # not the update timer's ("serial"), which trains on nothing
        timed = [w for i, w in enumerate(WAITS.get(name, [])) if i % per_run >= args.warmup]
        summary[name] = {
            "forwards": len(timed),
            "wait_ms": statistics.median(sum(s for _, s in w) * 1e3 for w in timed),
            "wait_for_slice0_ms": statistics.median(sum(s for i, s in w if i == 0) * 1e3 for w in timed),
            "samples_wait_ms": [round(sum(s for _, s in w) * 1e3, 2) for w in timed]}
        print(f"  {name:24s} forward waits for updates: {summary[name]['wait_ms']:7.1f} ms, of which for slice 0 "
              f"{summary[name]['wait_for_slice0_ms']:7.1f} ms (medians of {len(timed)} forwards)")
    report["forward_wait"] = summary
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def main() -> None:
    bench_schedule.new_optimizer = new_optimizer
    parse_args = bench_schedule.parse_args

    def two_schedules() -> Any:
        args = parse_args()
        args.schedules = [Schedule("backward", in_backward=True), Schedule(LANDED, in_backward=True)]
        return args

    bench_schedule.parse_args = two_schedules
    bench_schedule.main()
    args = two_schedules()
    if args.json:
        add_waits(args.json, args)


if __name__ == "__main__":
    main()
