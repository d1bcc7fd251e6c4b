"""The one-pass host update on this machine: whether it builds and passes its check, how long the
build took, and AdamW's update with its bfloat16 shadow in one pass against PyTorch's fused AdamW
alone and followed by a cast, over the same float32 tensors (Note: [One-pass update] in
``offload/kernels/one_pass.py``); and, clipped, a clip's scaling of the gradients as a pass of
its own before the one pass against the one pass multiplying them as it reads them (Note:
[Scaling in the update]). Rounds alternate the variants; medians.

Usage::

    python benchmarks/host_kernels.py --json benchmarks/results/host_kernels_cpu.json
    python benchmarks/host_kernels.py --cpu-dry-run      # toy sizes (CI)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from offload.kernels import build
from offload.kernels.one_pass import one_pass
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

BYTES = {"fused AdamW alone": 28, "fused AdamW, then a bf16 cast": 34, "one pass: AdamW and its bf16 shadow": 30,
         # The gradients read and written by the scaling, then read by the update; or read once and
         # written back scaled, as the clip leaves them.
         "clipped: a scaling pass, then the one pass": 38, "clipped: the one pass multiplying": 34}
#: The clip's coefficient: near 1, so that rounds of it leave the gradients' magnitude alone.
COEFFICIENT = torch.tensor(0.9999)


def variants(params: int, tensors: int) -> dict[str, Callable[[], None]]:
    """The three updates, each over tensors of its own (a slice's layout: parameters in one buffer)."""
    kernel = build.host_kernel(wait=True)
    size = params // tensors
    options = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01, "eps": 1e-8, "amsgrad": False,
               "maximize": False}
    made: dict[str, Callable[[], None]] = {}
    for name in BYTES:
        if ("one pass" in name) and kernel is None:
            continue
        flat, shadow = torch.randn(size * tensors) * 0.01, torch.empty(size * tensors, dtype=torch.bfloat16)
        lists = [list(flat.split(size)), [torch.randn(size) * 0.01 for _ in range(tensors)],
                 [torch.zeros(size) for _ in range(tensors)], [torch.zeros(size) for _ in range(tensors)], [],
                 [torch.tensor(1.0) for _ in range(tensors)]]
        if name.startswith("one pass"):
            made[name] = lambda lists=lists, shadow=shadow: one_pass(
                kernel, torch.ops.aten._fused_adamw_.default, lists, list(shadow.split(size)), options)
        elif name.startswith("clipped: a scaling"):
            made[name] = lambda lists=lists, shadow=shadow: ([g.mul_(COEFFICIENT) for g in lists[1]], one_pass(
                kernel, torch.ops.aten._fused_adamw_.default, lists, list(shadow.split(size)), options))
        elif name.startswith("clipped"):
            made[name] = lambda lists=lists, shadow=shadow: one_pass(
                kernel, torch.ops.aten._fused_adamw_.default, lists, list(shadow.split(size)), options, COEFFICIENT)
        elif "cast" in name:
            made[name] = lambda lists=lists, flat=flat, shadow=shadow: (torch._fused_adamw_(*lists, **options),
                                                                        shadow.copy_(flat))
        else:
            made[name] = lambda lists=lists: torch._fused_adamw_(*lists, **options)
    return made


def timed(made: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in made}
    for round_ in range(rounds + 1):
        order = list(made)[round_ % len(made):] + list(made)[:round_ % len(made)]
        for name in order:
            start = time.perf_counter()
            made[name]()
            if round_:  # the first round touches the state's pages
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(samples) for name, samples in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=50e6)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", default="1,all", help="thread counts to measure at, 'all' for PyTorch's")
    parser.add_argument("--cpu-dry-run", action="store_true", help="toy sizes")
    parser.add_argument("--json")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.cpu_dry_run:
        args.params, args.tensors, args.rounds = 2e5, 10, 2
    start = time.perf_counter()
    kernel = build.host_kernel(wait=True)
    built_s = time.perf_counter() - start
    report = {"command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
              "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__},
              "one_pass_available": kernel is not None, "unavailable_reason": build.unavailable_reason(),
              "build_and_check_s": built_s, "parameters": int(args.params), "tensors": args.tensors,
              "host_bytes_per_parameter": BYTES, "by_threads": {}}
    print(f"one-pass kernel: {'ready' if kernel is not None else 'off: ' + str(build.unavailable_reason())} "
          f"after {built_s:.1f} s (build or cache, and its check)")
    everything = torch.get_num_threads()
    for threads in args.threads.split(","):
        count = everything if threads == "all" else int(threads)
        torch.set_num_threads(count)
        medians = timed(variants(int(args.params), args.tensors), args.rounds)
        fused = medians["fused AdamW alone"]
        rows = {name: {"median_s": s, "vs_fused_alone": s / fused, "gb_per_s": BYTES[name] * args.params / s / 1e9}
                for name, s in medians.items()}
        report["by_threads"][str(count)] = rows
        for name, row in rows.items():
            print(f"{count:3d} threads  {name:40s} {row['median_s'] * 1e3:8.1f} ms  {row['vs_fused_alone']:5.3f}x  "
                  f"{row['gb_per_s']:6.1f} GB/s")
    torch.set_num_threads(everything)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
