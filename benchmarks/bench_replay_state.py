"""What replaying Python's and NumPy's generators costs a step (``offload/autograd/replay.py``).

Every checkpointed slice run captures both generators' states in forward, so that a layer drawing
from them (a layer drop by ``random.random()``) recomputes what it drew. This times those captures
and the comparisons that spare a replay to the runs that drew nothing, from inside one training
step of an MLP, against the step itself. The cost grows with slices × microbatches and does not
depend on the layers' size, so small layers in many slices and microbatches are the worst case.

Usage::

    python benchmarks/bench_replay_state.py --json benchmarks/results/replay_state_cpu_DATE.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload import OffloadModel  # noqa: E402
from offload.autograd import replay  # noqa: E402
from json_output import check_json_path  # benchmarks/json_output.py, next to this file


class _Timed:
    """Wraps ``LibraryRngCapture`` and ``LibraryRng.same_as`` with a clock; undone by :meth:`close`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.captures = 0
        self._capture, self._same_as = replay.LibraryRngCapture.__call__, replay.LibraryRng.same_as
        timed = self

        def capture(taker: replay.LibraryRngCapture) -> replay.LibraryRng:
            start = time.perf_counter()
            try:
                return timed._capture(taker)
            finally:
                timed.seconds += time.perf_counter() - start
                timed.captures += 1

        def same_as(state: replay.LibraryRng, other: replay.LibraryRng) -> bool:
            start = time.perf_counter()
            try:
                return timed._same_as(state, other)
            finally:
                timed.seconds += time.perf_counter() - start

        replay.LibraryRngCapture.__call__ = capture  # type: ignore[method-assign]
        replay.LibraryRng.same_as = same_as  # type: ignore[method-assign]

    def close(self) -> None:
        replay.LibraryRngCapture.__call__ = self._capture  # type: ignore[method-assign]
        replay.LibraryRng.same_as = self._same_as  # type: ignore[method-assign]


def measure(width: int, depth: int, slices: int, microbatches: int, rows: int, steps: int) -> dict:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                   for _ in range(depth)])
    model = OffloadModel(layers, device="cpu", num_slices=slices, num_microbatches=microbatches)
    x = torch.randn(rows, width)
    for _ in range(3):
        model(x).sum().backward()
    timed = _Timed()
    step_ms, spent_ms = [], []
    try:
        for _ in range(steps):
            before, start = timed.seconds, time.perf_counter()
            model(x).sum().backward()
            step_ms.append((time.perf_counter() - start) * 1e3)
            spent_ms.append((timed.seconds - before) * 1e3)
    finally:
        timed.close()
    step, spent = statistics.median(step_ms), statistics.median(spent_ms)
    return {"width": width, "depth": depth, "slices": slices, "microbatches": microbatches, "rows": rows,
            "captures_per_step": timed.captures // steps, "step_ms": step, "replay_state_ms": spent,
            "share": spent / step, "us_per_capture": spent * 1e3 / (timed.captures // steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15, help="timed steps per shape (median)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    shapes = [(256, 16, 16, 8, 64),  # the worst case: small layers, 16 slices x 8 microbatches
              (1024, 8, 4, 1, 256)]  # bench_cpu_overhead.py's default shape
    results = [measure(*shape, steps=args.steps) for shape in shapes]
    for r in results:
        print(f"width {r['width']:5d}, {r['slices']:2d} slices x {r['microbatches']} microbatches: "
              f"step {r['step_ms']:.1f} ms, generator states {r['replay_state_ms']:.2f} ms "
              f"({r['share']:.1%}, {r['us_per_capture']:.0f} us a capture)")
    if args.json:
        record = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "results": results}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
