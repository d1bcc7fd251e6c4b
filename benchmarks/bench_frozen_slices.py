"""Data parallel with frozen layers: what the slices without gradients cost a synced backward.

Every synced backward sends one small header per slice with parameters, those this rank computes
no gradient of too (Note: [Ranks that disagree on requires_grad] in ``offload/data_parallel.py``).
This runs two gloo ranks on loopback over an ``nn.Sequential`` of ``--slices`` Linear layers, one
per slice, of which the first ``--frozen`` are frozen, and reports the median backward per rank
count of frozen slices (``--frozen`` may name several), each over ``--steps`` steps after
``--warmup``. The forward and backward of the trained slices are the same in every configuration,
so the difference between them is what the frozen slices' headers cost.

Usage::

    python benchmarks/bench_frozen_slices.py --frozen 0 40 --json benchmarks/results/frozen_slices_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from json_output import check_json_path  # benchmarks/json_output.py, next to this file


def _rank(rank: int, args: argparse.Namespace, store: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from offload import OffloadModel
    try:
        for frozen in args.frozen:
            torch.manual_seed(0)
            layers = [nn.Linear(args.width, args.width) for _ in range(args.slices)]
            for layer in layers[:frozen]:
                layer.requires_grad_(False)
            model = OffloadModel(nn.Sequential(*layers), device="cpu", num_slices=args.slices,
                                 process_group=dist.group.WORLD)
            x = torch.randn(8, args.width)
            times = []
            for step in range(args.warmup + args.steps):
                loss = model(x).square().mean()
                dist.barrier()  # both ranks start the backward together: its time is the collectives'
                start = time.perf_counter()
                loss.backward()
                if step >= args.warmup:
                    times.append(time.perf_counter() - start)
            if rank == 0:
                results[frozen] = {"backward_ms_median": 1e3 * statistics.median(times),
                                   "backward_ms_min": 1e3 * min(times)}
            del model
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slices", type=int, default=48)
    parser.add_argument("--frozen", type=int, nargs="+", default=[0, 40], help="frozen slices (several: one run each)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    if any(not 0 <= f < args.slices for f in args.frozen):
        parser.error(f"--frozen: each count must be at least 0 and below --slices ({args.slices})")
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(args, os.path.join(folder, "store"), results), nprocs=2)
        out = {"slices": args.slices, "width": args.width, "steps": args.steps,
               "by_frozen": {str(k): results[k] for k in args.frozen}}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    sys.exit(main() and 0)
