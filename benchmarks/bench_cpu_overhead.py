"""What OffloadModel's machinery costs on the CPU, where no copy can overlap anything.

Times one training step (forward, backward, SGD step) of the same MLP three ways, interleaved in
one process so that machine noise hits all three alike:

- ``plain``: the unwrapped model.
- ``checkpoint``: ``torch.utils.checkpoint.checkpoint_sequential`` (non-reentrant) with the same
  segments as OffloadModel's slices: the same recompute, no copies.
- ``offload``: ``OffloadModel(device="cpu")``: the same recompute plus every copy (host to "device"
  slots, boundary activations, gradients), synchronously.

The ratio offload / checkpoint is the overhead of the offloading machinery itself; the targets
(issue 8) are at most 1.10 at 256 rows per step and at most 1.05 from 512 rows. Most of it is
memory copies whose size does not depend on the batch (each slice's parameters are copied into a
slot, gradients out of one), so the ratio falls as rows per step grow; the default run sweeps the
batch size to show where the targets are met.

To attribute the overhead, the script also counts each variant's minor page faults per step, and
after the timed steps runs as many offload steps again with the copy engine's ``load`` and
``offload_many`` timed from the outside: the time per step spent copying.

Usage::

    python benchmarks/bench_cpu_overhead.py                  # sweep of batch sizes, prints a table
    python benchmarks/bench_cpu_overhead.py --batch 512 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

from offload import OffloadModel
from offload.model import engine_of

from benchmark import measure_bandwidth  # benchmarks/benchmark.py, next to this file
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

#: (rows per step from which a target applies, the largest offload / checkpoint ratio allowed).
TARGETS = ((256, 1.10), (512, 1.05))


def target_for(batch: int) -> float | None:
    """The issue's target for ``batch`` rows per step, or None below the smallest batch it covers."""
    applying = [limit for rows, limit in TARGETS if batch >= rows]
    return applying[-1] if applying else None


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def copy_seconds_per_step(offloaded: OffloadModel, step: Callable[[], None], steps: int) -> float:
    """Median time per step spent inside the copy engine's loads and offloads (the copies with
    their bookkeeping), measured by wrapping them on this model's engine only."""
    copies = engine_of(offloaded).copies
    spent = [0.0]

    def timed(method: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return wrapper

    copies.load, copies.offload_many = timed(copies.load), timed(copies.offload_many)
    per_step = []
    try:
        for _ in range(steps):
            spent[0] = 0.0
            step()
            per_step.append(spent[0])
    finally:
        del copies.load, copies.offload_many  # back to the class's methods
    return statistics.median(per_step)


def build_mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def measure(args: argparse.Namespace, batch: int) -> dict:
    """Median step times of the three variants at one batch size."""
    torch.manual_seed(0)
    base = build_mlp(args.width, args.depth)
    plain = copy.deepcopy(base)
    checkpointed = copy.deepcopy(base)
    offloaded = OffloadModel(copy.deepcopy(base), device="cpu", num_slices=args.slices)
    segments = len(offloaded.partition)
    x = torch.randn(batch, args.width)

    def step_fn(model: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            forward(x).float().pow(2).mean().backward()
            optimizer.step()

        return step

    variants = {
        "plain": step_fn(plain, plain),
        "checkpoint": step_fn(
            checkpointed, lambda inp: checkpoint_sequential(checkpointed, segments, inp, use_reentrant=False)
        ),
        "offload": step_fn(offloaded, offloaded),
    }
    for _ in range(args.warmup):
        for step in variants.values():
            step()
    traffic_before = engine_of(offloaded).traffic()
    times: dict[str, list[float]] = {name: [] for name in variants}
    faults: dict[str, list[int]] = {name: [] for name in variants}
    names = list(variants)
    for k in range(args.steps):
        # Rotate the order so no variant always runs right after the same neighbour.
        for name in names[k % len(names):] + names[:k % len(names)]:
            faults_before = minor_faults()
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
            faults[name].append(minor_faults() - faults_before)
    copied = sum(after - before for after, before in zip(engine_of(offloaded).traffic(), traffic_before)) / args.steps
    medians = {name: statistics.median(values) for name, values in times.items()}
    # Per-round ratios cancel slow drifts of the machine's speed that hit all variants alike.
    paired = statistics.median(o / c for o, c in zip(times["offload"], times["checkpoint"]))
    copying = copy_seconds_per_step(offloaded, variants["offload"], args.steps)
    engine = engine_of(offloaded)
    target = target_for(batch)
    ratio = medians["offload"] / medians["checkpoint"]
    return {
        "batch": batch,
        "segments": segments,
        "median_step_s": medians,
        "all_step_s": times,
        "offload_over_checkpoint": ratio,
        "offload_over_checkpoint_paired": paired,
        "target_offload_over_checkpoint": target,
        "meets_target": None if target is None else ratio <= target,
        "meets_target_paired": None if target is None else paired <= target,
        "median_minor_faults_per_step": {name: statistics.median(values) for name, values in faults.items()},
        "copy_engine_s_per_step": copying,
        "offload_over_plain": medians["offload"] / medians["plain"],
        "parameter_bytes": sum(p.numel() * p.element_size() for p in offloaded.parameters()),
        "copied_bytes_per_step": copied,
        "slot_loads": engine.slots.loads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8, help="Linear+GELU blocks")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 512, 1024, 2048],
                        help="rows per step; several values make a sweep")
    parser.add_argument("--slices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.threads:
        torch.set_num_threads(args.threads)

    runs = [measure(args, batch) for batch in args.batch]
    # Slice-sized buffers (8 MiB), copied warm: the rate the slot and gradient copies see.
    rate = measure_bandwidth(torch.device("cpu"), nbytes=8 * 2**20, repeats=20)["host_to_device"]
    print(f"MLP {args.depth}x(Linear {args.width}+GELU), {runs[0]['segments']} slices = checkpoint segments, "
          f"{torch.get_num_threads()} threads, median of {args.steps} interleaved steps")
    print(f"{'rows':>6}{'plain ms':>11}{'checkpoint ms':>15}{'offload ms':>12}{'offload/ckpt':>14}"
          f"{'paired':>9}{'target':>8}{'offload/plain':>15}{'copies ms':>11}{'faults ckpt/offload':>21}")
    for run in runs:
        m = run["median_step_s"]
        target = run["target_offload_over_checkpoint"]
        f = run["median_minor_faults_per_step"]
        faults = f"{f['checkpoint']:.0f}/{f['offload']:.0f}"
        print(f"{run['batch']:>6}{m['plain'] * 1e3:>11.1f}{m['checkpoint'] * 1e3:>15.1f}{m['offload'] * 1e3:>12.1f}"
              f"{run['offload_over_checkpoint']:>14.3f}{run['offload_over_checkpoint_paired']:>9.3f}"
              f"{'-' if target is None else f'{target:.2f}':>8}{run['offload_over_plain']:>15.3f}"
              f"{run['copy_engine_s_per_step'] * 1e3:>11.1f}{faults:>21}")
    print("offload/ckpt: ratio of medians; paired: median of per-round ratios. Targets: <= 1.10 at 256 rows, "
          "<= 1.05 from 512; copies: time inside the copy engine per offload step (extra steps)")
    copied = runs[-1]["copied_bytes_per_step"]
    print(f"copies per step: {copied / 1e6:.1f} MB at rows={runs[-1]['batch']}; at this machine's "
          f"{rate / 1e9:.1f} GB/s copy rate that is {copied / rate * 1e3:.1f} ms")
    if args.json:
        result = {
            "benchmark": "cpu_overhead",
            "command": "python " + " ".join(sys.argv),
            # glibc's heap settings change how often freed memory is faulted back in (see docs/performance.md).
            "environment": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
            "config": vars(args) | {"torch": torch.__version__, "threads": torch.get_num_threads()},
            "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
            "date": datetime.date.today().isoformat(),
            "targets_offload_over_checkpoint": [{"from_rows": rows, "at_most": limit} for rows, limit in TARGETS],
            "copy_rate_bytes_per_s": rate,
            "runs": runs,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
