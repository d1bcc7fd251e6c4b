"""What the host of a GPU run is, in a few seconds: the facts a step time on it depends on.

CPU model, cores, NUMA nodes, transparent huge pages, the host memory bandwidth of a large copy
at the update's thread count (``OffloadOptimizer``'s worker takes PyTorch's setting unless told
otherwise, ``torch.get_num_threads()``) and at one thread, and the pinned link each way
(``benchmarks/benchmark.py``'s ``measure_bandwidth``; on the CPU, a host copy).

Usage::

    python benchmarks/host_facts.py --json host.json
    python benchmarks/host_facts.py --cpu-dry-run --json /tmp/host.json   # small sizes
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import measure_bandwidth  # noqa: E402
from json_output import check_json_path  # benchmarks/json_output.py, next to this file


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpu_model() -> str:
    for line in (read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def copy_bandwidth(nbytes: int, threads: int, repeats: int = 5) -> float:
    """Bytes read plus written per second by ``dst.copy_(src)`` over ``nbytes`` at ``threads`` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.ones(nbytes // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # first touch
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src)
        return 2 * nbytes * repeats / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)


def facts(dry: bool) -> dict:
    nodes = sorted(glob.glob("/sys/devices/system/node/node[0-9]*"))
    threads = torch.get_num_threads()
    nbytes = (16 if dry else 1024) * 2**20
    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    return {
        "cpu_model": cpu_model(), "logical_cores": os.cpu_count(), "physical_cores": psutil.cpu_count(logical=False),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "numa_nodes": {os.path.basename(n): read(os.path.join(n, "cpulist")) for n in nodes},
        "transparent_hugepage": {k: read(f"/sys/kernel/mm/transparent_hugepage/{k}") for k in ("enabled", "defrag")},
        "host_memory_bytes": psutil.virtual_memory().total,
        "torch_threads": threads,
        "copy_bytes_per_s_at_torch_threads": copy_bandwidth(nbytes, threads),
        "copy_bytes_per_s_at_one_thread": copy_bandwidth(nbytes, 1),
        "link_bytes_per_s": measure_bandwidth(device, nbytes=nbytes, repeats=3 if dry else 10),
        "torch": torch.__version__, "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="small sizes, the CPU only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    check_json_path(parser, args.json)
    result = facts(args.cpu_dry_run)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
