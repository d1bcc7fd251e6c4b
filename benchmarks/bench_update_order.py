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
that forward loads slice 0 first, which the old order updated last.

Usage::

    python benchmarks/bench_update_order.py --update-sleep-ns 5 --threads 1 --dim 1024 --slices 8 \
        --ratios 2 4 --steps 6 --rounds 3 --resident --json benchmarks/results/update_order_cpu.json
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_schedule  # noqa: E402
from bench_schedule import Schedule  # noqa: E402

LANDED = "backward+landed-order"
_new_optimizer = bench_schedule.new_optimizer


def new_optimizer(args: Any, model: Any, schedule: Schedule) -> Any:
    """``bench_schedule``'s optimizer; for :data:`LANDED`, with its update worker first in, first out."""
    optimizer = _new_optimizer(args, model, schedule)
    if schedule.name == LANDED:
        optimizer._updates._start_worker()
        optimizer._updates.worker.by_key = False
    return optimizer


def main() -> None:
    bench_schedule.new_optimizer = new_optimizer
    parse_args = bench_schedule.parse_args

    def two_schedules() -> Any:
        args = parse_args()
        args.schedules = [Schedule("backward", in_backward=True), Schedule(LANDED, in_backward=True)]
        return args

    bench_schedule.parse_args = two_schedules
    bench_schedule.main()


if __name__ == "__main__":
    main()
