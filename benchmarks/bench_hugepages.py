"""Whether transparent huge pages speed up the host update: PyTorch's fused AdamW over float32
tensors in anonymous private mappings (as ``offload/streams/pinned.py`` maps the host copies),
with and without ``madvise(MADV_HUGEPAGE)``, rounds alternating, medians. Reports the kernel's THP
settings and how many huge pages the advised mappings got (``AnonHugePages``): on a machine whose
THP is ``never``, or whose defragmentation gives none, the two are the same run.

Usage::

    python benchmarks/bench_hugepages.py --json benchmarks/results/hugepages_cpu_2026-11-28.json
    python benchmarks/bench_hugepages.py --params 16e6 --rounds 3      # smaller
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import math
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE = 14  # include/uapi/asm-generic/mman-common.h
HUGE = 2 << 20


def mapped(numel: int, huge: bool) -> torch.Tensor:
    """A float32 tensor of ``numel`` random values in a private anonymous mapping, 2 MiB-aligned,
    advised for huge pages before its first touch where ``huge``."""
    nbytes = numel * 4
    mapping = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = (ctypes.c_char * len(mapping)).from_buffer(mapping)
    start = ctypes.addressof(view)
    offset = (-start) % HUGE
    if huge and _libc.madvise(start + offset, nbytes, MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_HUGEPAGE) failed")
    tensor = torch.frombuffer(mapping, dtype=torch.float32, count=numel, offset=offset)
    tensor.copy_(torch.rand(numel))
    del view  # the tensor keeps the mapping alive through its buffer
    return tensor


def anon_huge_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def adamw(numel: int, tensors: int, huge: bool) -> torch.optim.Optimizer:
    """Fused AdamW over ``tensors`` parameters, their gradients and both moments all mapped alike."""
    params = [mapped(numel // tensors, huge).requires_grad_() for _ in range(tensors)]
    for p in params:
        p.grad = mapped(p.numel(), huge)
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    optimizer.step()  # allocates the state, which is then moved into mappings of the same kind
    for p in params:
        for key in ("exp_avg", "exp_avg_sq"):
            moment = mapped(p.numel(), huge)
            moment.copy_(optimizer.state[p][key])
            optimizer.state[p][key] = moment
    return optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=128e6)
    parser.add_argument("--tensors", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each, alternating")
    parser.add_argument("--steps", type=int, default=7, help="timed steps a round (after one)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if min(args.tensors, args.rounds, args.steps) < 1:
        parser.error("--tensors, --rounds and --steps must be at least 1")
    if not (math.isfinite(args.params) and args.params >= args.tensors):
        parser.error(f"--params must be at least --tensors ({args.tensors}): each tensor holds "
                     f"--params / --tensors values; got {args.params:g}")
    check_json_path(parser, args.json)
    numel = int(args.params)
    thp = {name: Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
           for name in ("enabled", "defrag") if Path(f"/sys/kernel/mm/transparent_hugepage/{name}").exists()}
    rounds: dict[str, list[float]] = {"4 KiB pages": [], "huge pages advised": []}
    huge_bytes = []
    for _ in range(args.rounds):
        for name in rounds:
            huge = name.startswith("huge")
            before = anon_huge_bytes()
            optimizer = adamw(numel, args.tensors, huge)
            if huge:
                huge_bytes.append(anon_huge_bytes() - before)
            optimizer.step()
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                optimizer.step()
                times.append(time.perf_counter() - start)
            rounds[name].append(statistics.median(times))
            del optimizer
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "date": str(datetime.date.today()),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "thp": thp,
        "parameters": numel, "tensors": args.tensors,
        "huge_page_bytes_per_round": huge_bytes, "mapped_bytes_per_round": numel * 16,
        "median_step_s": {name: statistics.median(v) for name, v in rounds.items()},
        "rounds_s": rounds,
    }
    for name, seconds in report["median_step_s"].items():
        print(f"{name:20s} {seconds * 1e3:7.1f} ms  {28 * numel / seconds / 1e9:5.1f} GB/s  rounds "
              f"{[round(s * 1e3, 1) for s in rounds[name]]}")
    print(f"THP {thp}; huge pages the advised mappings got: {[b >> 20 for b in huge_bytes]} MiB of "
          f"{numel * 16 >> 20} MiB mapped")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
