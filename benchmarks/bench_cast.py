"""Where to cast float32 masters to the compute dtype: on the host or on the device.

OffloadModel with ``compute_dtype`` casts each slice on the host, into a pinned shadow, once per
forward, and loads the half-precision bytes (twice per step: forward and backward). The
alternative loads float32 and casts on the device. Per slice of ``N`` float32 bytes and one step:

- host cast: cast N bytes on the CPU once, then load N/2 bytes twice;
- device cast: load N bytes twice, cast on the device twice.

This script measures the pieces: the host cast rate, and on a GPU the pinned load bandwidth and
the device cast rate, then prints the per-step time of both strategies for one slice.

Usage::

    python benchmarks/bench_cast.py [--mib 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable

import torch
from json_output import check_json_path  # benchmarks/json_output.py, next to this file


def seconds(fn: Callable[[], None], repeats: int, cuda: bool) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1e3 / repeats
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mib", type=int, default=256, help="float32 MiB in one slice")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.mib < 1 or args.repeats < 1:
        parser.error("--mib and --repeats must be at least 1")
    dtype = getattr(torch, args.dtype)
    cuda = torch.cuda.is_available()
    numel = args.mib * 2**20 // 4
    master = torch.randn(numel, pin_memory=cuda)
    shadow = torch.empty(numel, dtype=dtype, pin_memory=cuda)
    result: dict = {
        "command": "python " + " ".join(sys.argv),
        "date": datetime.date.today().isoformat(),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
        "device_name": torch.cuda.get_device_name() if cuda else None,
        "slice_float32_bytes": numel * 4,
        "compute_dtype": args.dtype,
    }
    host_cast = seconds(lambda: shadow.copy_(master), args.repeats, cuda=False)
    result["host_cast_s"] = host_cast
    result["host_cast_float32_gb_per_s"] = numel * 4 / host_cast / 1e9
    print(f"host cast float32 -> {args.dtype}: {numel * 4 / host_cast / 1e9:.1f} GB/s of float32 "
          f"({torch.get_num_threads()} threads)")
    if cuda:
        staging = torch.empty(numel, device="cuda")
        slot = torch.empty(numel, dtype=dtype, device="cuda")
        load_half = seconds(lambda: slot.copy_(shadow, non_blocking=True), args.repeats, cuda=True)
        load_full = seconds(lambda: staging.copy_(master, non_blocking=True), args.repeats, cuda=True)
        device_cast = seconds(lambda: slot.copy_(staging), args.repeats, cuda=True)
        host_strategy = host_cast + 2 * load_half
        device_strategy = 2 * (load_full + device_cast)
        result |= {"load_half_s": load_half, "load_float32_s": load_full, "device_cast_s": device_cast,
                   "host_strategy_s_per_step": host_strategy, "device_strategy_s_per_step": device_strategy}
        print(f"load {args.dtype}: {load_half * 1e3:.2f} ms, load float32: {load_full * 1e3:.2f} ms, "
              f"device cast: {device_cast * 1e3:.2f} ms")
        print(f"per step and slice: host cast {host_strategy * 1e3:.2f} ms (of which CPU {host_cast * 1e3:.2f} ms, "
              f"overlapped with compute) vs device cast {device_strategy * 1e3:.2f} ms of link and device time")
    else:
        print("no GPU: only the host cast rate is measured here")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
