"""Where an OffloadModel training step spends its time: torch.profiler over a few steps of a
benchmark case, as tables of the operations with the most host time and the most device time.

Usage::

    python benchmarks/profile_step.py --case gpt-compute-bound-bf16 [--steps 3] [--trace trace.json]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import CASES, make_step, synchronize  # noqa: E402

from offload import OffloadModel  # noqa: E402
from offload.planning.presets import build_preset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--case", choices=sorted(CASES), default="gpt-compute-bound-bf16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25, help="operations per table")
    parser.add_argument("--trace", help="also write a Chrome trace here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    case = CASES[args.case]
    torch.manual_seed(0)
    preset = build_preset(case.preset, **case.overrides)
    batch, target = preset.make_batch(case.batch, device)
    model = OffloadModel(copy.deepcopy(preset.model), device=device, num_slices=case.num_slices,
                         num_microbatches=case.num_microbatches, compute_dtype=case.compute_dtype)
    step = make_step(model, model, preset, batch, target, device)
    for _ in range(2):
        step()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        synchronize(device)
    table = prof.key_averages()
    print(f"{args.case}: {args.steps} steps, host time by operation (self)")
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
    if device.type == "cuda":
        print(f"{args.case}: {args.steps} steps, device time by operation (self)")
        print(table.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
