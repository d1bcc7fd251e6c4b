"""The disk tier: this machine's disk against what OffloadOptimizer's disk tier gets from it, and
the host memory each parameter costs with the optimizer state in RAM and on disk.

Four measurements, written to one JSON file:

1. **The raw disk.** Sequential direct-I/O (``O_DIRECT``) write, then read, of one file of
   ``--raw-gib`` GiB (default 2) in ``--dir``, in chunks of 64 MiB from one page-aligned buffer,
   the file preallocated first as the tier's are: ``disk_write_gbps`` and ``disk_read_gbps``
   (GB/s, 1 GB = 1e9 bytes; the fastest of ``--raw-rounds``). Also both at once (one thread
   writing one file while another reads a second): ``disk_mixed_*``, what the tier's reader and
   writer share during a step.
2. **The tier during steps.** An MLP of ``--params`` float32 parameters in ``--slices`` slices,
   trained with ``OffloadOptimizer(torch.optim.AdamW, fused=True, disk_tier=DIR)`` for
   ``--steps`` steps (the first writes the state, the others read and write it). The tier's read
   and write bandwidth = bytes moved / seconds spent inside its read and write calls, summed over
   the steps after the first; ``tier_read_fraction`` and ``tier_write_fraction`` = those ÷ the
   raw disk's (target ≥ 0.8). Its reader and writer run at the same time, so ``*_vs_mixed``
   compare them with the raw disk doing both at once as well.
3. **Host bytes per parameter**, each configuration in a child process of its own: what
   ``memory_footprint()`` counts plus the optimizer state tensors in RAM, per parameter, with the
   state in RAM (``host_bytes_per_param_ram``, fp32 AdamW) and on disk
   (``host_bytes_per_param_disk``: masters, the gradient pool, the scalars and the window of three
   slices' state), and each child's peak RSS over its RSS before building the model.
   A third child puts the masters on disk too, under a bfloat16 compute dtype
   (``host_bytes_per_param_masters_on_disk``: the shadow, the gradient pool, the scalars and the
   windows, the masters' counting three slices' masters and gradients, in RAM while the optimizer
   steps and dropped between steps).
4. **Exact**: ``--exact-steps`` steps of a small model with the state in RAM and on disk give the
   same parameters and optimizer state bit for bit (``exact``); likewise with the masters on disk
   too, against masters in RAM (``exact_masters_on_disk``).

Usage::

    python benchmarks/bench_storage.py --json benchmarks/results/storage_cpu.json
    python benchmarks/bench_storage.py --dir /nvme/scratch --params 200e6 --json storage.json
    python benchmarks/bench_storage.py --small --json /tmp/storage.json       # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload import DiskTier, OffloadModel, OffloadOptimizer
from offload.streams.disk import CHUNK, AlignedBuffer, direct_io_supported
from json_output import check_json_path  # benchmarks/json_output.py, next to this file

GB = 1e9


# -- 1. the raw disk ---------------------------------------------------------------------------------


def _open(path: Path, direct: bool) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)


def _write_file(fd: int, nbytes: int, buffer: AlignedBuffer) -> float:
    os.posix_fallocate(fd, 0, nbytes)
    start = time.perf_counter()
    for offset in range(0, nbytes, CHUNK):
        os.pwritev(fd, [buffer.view(0, min(CHUNK, nbytes - offset))], offset)
    os.fdatasync(fd)
    return time.perf_counter() - start


def _read_file(fd: int, nbytes: int, buffer: AlignedBuffer) -> float:
    start = time.perf_counter()
    for offset in range(0, nbytes, CHUNK):
        os.preadv(fd, [buffer.view(0, min(CHUNK, nbytes - offset))], offset)
    return time.perf_counter() - start


def raw_disk(directory: Path, nbytes: int, direct: bool, rounds: int) -> dict[str, Any]:
    """Sequential write then read of one file, then a write and a read of two files at once; the
    fastest of ``rounds`` of each (the disk's capability: what the tier is compared with)."""
    buffers = [AlignedBuffer(CHUNK) for _ in range(2)]
    for b in buffers:  # incompressible contents
        b.tensor.copy_(torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8))
    paths = [directory / f"bench-storage-{k}.raw" for k in range(2)]
    fds = [_open(p, direct) for p in paths]
    write_s = read_s = mixed_write_s = mixed_read_s = float("inf")
    try:
        for _ in range(rounds):
            write_s = min(write_s, _write_file(fds[0], nbytes, buffers[0]))
            read_s = min(read_s, _read_file(fds[0], nbytes, buffers[0]))
            # Both at once: the second file is written while the first is read.
            times: dict[str, float] = {}
            reader = threading.Thread(target=lambda: times.__setitem__("read", _read_file(fds[0], nbytes, buffers[0])))
            reader.start()
            times["write"] = _write_file(fds[1], nbytes, buffers[1])
            reader.join()
            mixed_write_s, mixed_read_s = min(mixed_write_s, times["write"]), min(mixed_read_s, times["read"])
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            p.unlink(missing_ok=True)
    return {"file_bytes": nbytes, "direct_io": direct, "rounds": rounds,
            "disk_write_gbps": nbytes / write_s / GB, "disk_read_gbps": nbytes / read_s / GB,
            "disk_mixed_write_gbps": nbytes / mixed_write_s / GB, "disk_mixed_read_gbps": nbytes / mixed_read_s / GB}


# -- 2. and 3. training steps (in a child process per configuration) ----------------------------------


def mlp(params: float, width: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = max(2, round(params / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def train_steps(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration: build, train ``--steps`` steps, count bytes and time (run as a child)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    before = rss_bytes()
    masters = args.phase == "masters"  # bfloat16 compute, the masters on disk as well
    model = OffloadModel(mlp(args.params, args.width), device="cpu", num_slices=args.slices,
                         compute_dtype=torch.bfloat16 if masters else None,
                         masters=DiskTier(args.dir) if masters else None)
    tier = DiskTier(args.dir) if args.phase in ("disk", "masters") else None
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-4, fused=True, disk_tier=tier)
    parameters = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(0))
    step_s = []
    counters = None
    for step in range(args.steps):
        start = time.perf_counter()
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # waits for the update: the step's whole cost
        step_s.append(time.perf_counter() - start)
        if step == 0 and optimizer._tier is not None:
            optimizer.synchronize()
            counters = optimizer._tier.counters
            first = (counters.read_bytes, counters.read_seconds, counters.write_bytes, counters.write_seconds)
    optimizer.synchronize()
    footprint = model.memory_footprint()
    state_in_ram = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))
    host = (footprint.host_copies + footprint.host_shadows + footprint.host_pool + state_in_ram
            + footprint.host_disk_window)
    result: dict[str, Any] = {
        "parameters": parameters, "num_slices": args.slices, "steps": args.steps,
        "median_step_s": statistics.median(step_s[1:]) if len(step_s) > 1 else step_s[0],
        "host_bytes": {"host_copies": footprint.host_copies, "host_pool": footprint.host_pool,
                       "optimizer_state_in_ram": state_in_ram, "host_disk_window": footprint.host_disk_window,
                       "total": host},
        "host_bytes_per_param": host / parameters,
        "disk_bytes": footprint.disk,
        # Peak: includes what is transient (the layers before they are copied into host buffers,
        # the state AdamW creates at its first step before the tier takes it); after: what stays.
        "rss_growth_bytes_per_param": (peak_rss_bytes() - before) / parameters,
        "rss_growth_after_steps_bytes_per_param": (rss_bytes() - before) / parameters,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    if counters is not None:
        read_bytes, read_s = counters.read_bytes - first[0], counters.read_seconds - first[1]
        write_bytes, write_s = counters.write_bytes - first[2], counters.write_seconds - first[3]
        result.update({
            "direct_io": optimizer._tier.direct,
            "tier_read_bytes_per_step": read_bytes / (args.steps - 1),
            "tier_write_bytes_per_step": write_bytes / (args.steps - 1),
            "tier_read_gbps": read_bytes / read_s / GB, "tier_write_gbps": write_bytes / write_s / GB,
            "tier_read_busy_s_per_step": read_s / (args.steps - 1),
            "tier_write_busy_s_per_step": write_s / (args.steps - 1),
        })
    optimizer.close()
    return result


def child(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--phase", phase, "--dir", str(args.dir), "--params", str(args.params),
               "--width", str(args.width), "--slices", str(args.slices), "--steps", str(args.steps),
               "--batch", str(args.batch)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the {phase} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- 4. exact --------------------------------------------------------------------------------------------


def exact(directory: Path, steps: int, masters: bool = False) -> bool:
    """A few steps with the state on disk (and with ``masters``, the masters too, under a bfloat16
    compute dtype) against everything in RAM, bit for bit."""
    runs = []
    for tier in (None, DiskTier(directory)):
        model = OffloadModel(mlp(2e5, 64), device="cpu", num_slices=4,
                             compute_dtype=torch.bfloat16 if masters else None,
                             masters=tier if masters else None)
        runs.append((model, OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=tier)))
    for step in range(steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        for model, optimizer in runs:
            model(x).float().pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    (ram_model, ram), (disk_model, on_disk) = runs
    same = all(torch.equal(a, b) for a, b in zip(ram_model.parameters(), disk_model.parameters()))
    a, b = ram.state_dict()["state"], on_disk.state_dict()["state"]
    same = same and a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in a)
    on_disk.close()
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="a directory on the disk to measure (default: the system's temporary directory)")
    parser.add_argument("--raw-gib", type=float, default=2.0, help="size of the raw disk test file")
    parser.add_argument("--raw-rounds", type=int, default=2, help="rounds of the raw disk test (the fastest counts)")
    parser.add_argument("--params", type=float, default=100e6, help="parameters of the model trained with the tier")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--exact-steps", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="tiny sizes: a smoke test in seconds")
    parser.add_argument("--phase", choices=["ram", "disk", "masters"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    check_json_path(parser, args.json)
    if args.phase is not None:
        print(json.dumps(train_steps(args)))
        return
    if args.small:
        args.raw_gib, args.params, args.width, args.steps = 1 / 16, 2e6, 256, 3
    args.dir.mkdir(parents=True, exist_ok=True)

    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; disk under {args.dir}",
          flush=True)
    direct = direct_io_supported(args.dir)
    raw = raw_disk(args.dir, int(args.raw_gib * 2**30) // CHUNK * CHUNK or CHUNK, direct, args.raw_rounds)
    print(f"raw disk ({'direct' if direct else 'buffered'} I/O, {raw['file_bytes'] / 2**30:.2f} GiB): write "
          f"{raw['disk_write_gbps']:.2f} GB/s, read {raw['disk_read_gbps']:.2f} GB/s; both at once: write "
          f"{raw['disk_mixed_write_gbps']:.2f}, read {raw['disk_mixed_read_gbps']:.2f} GB/s", flush=True)
    in_ram = child(args, "ram")
    on_disk = child(args, "disk")
    masters = child(args, "masters")
    print(f"{on_disk['parameters'] / 1e6:.0f} M parameters, {args.slices} slices, fused AdamW, {args.steps} steps:")
    for name, run in (("state in RAM", in_ram), ("state on disk", on_disk), ("+ masters, bf16", masters)):
        print(f"  {name:14s} {run['host_bytes_per_param']:5.2f} host bytes/parameter (RSS growth: peak "
              f"{run['rss_growth_bytes_per_param']:5.2f}, after the steps "
              f"{run['rss_growth_after_steps_bytes_per_param']:5.2f}), "
              f"{run['median_step_s']:.2f} s/step")
    fractions = {
        "tier_read_fraction": on_disk["tier_read_gbps"] / raw["disk_read_gbps"],
        "tier_write_fraction": on_disk["tier_write_gbps"] / raw["disk_write_gbps"],
        "tier_read_fraction_vs_mixed": on_disk["tier_read_gbps"] / raw["disk_mixed_read_gbps"],
        "tier_write_fraction_vs_mixed": on_disk["tier_write_gbps"] / raw["disk_mixed_write_gbps"],
    }
    print(f"  tier: read {on_disk['tier_read_gbps']:.2f} GB/s ({fractions['tier_read_fraction']:.2f} of raw, "
          f"{fractions['tier_read_fraction_vs_mixed']:.2f} of raw with both at once), write "
          f"{on_disk['tier_write_gbps']:.2f} GB/s ({fractions['tier_write_fraction']:.2f}, "
          f"{fractions['tier_write_fraction_vs_mixed']:.2f})")
    same = exact(args.dir, args.exact_steps)
    same_masters = exact(args.dir, args.exact_steps, masters=True)
    print(f"exact: {same}; with the masters on disk too (bfloat16 compute): {same_masters}")

    if args.json:
        report = {
            "command": "python " + " ".join(sys.argv), "date": datetime.date.today().isoformat(),
            "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                        "torch": torch.__version__, "dir": str(args.dir)},
            "disk_read_gbps": raw["disk_read_gbps"], "disk_write_gbps": raw["disk_write_gbps"],
            "tier_read_fraction": fractions["tier_read_fraction"],
            "tier_write_fraction": fractions["tier_write_fraction"],
            "host_bytes_per_param_ram": in_ram["host_bytes_per_param"],
            "host_bytes_per_param_disk": on_disk["host_bytes_per_param"],
            "host_bytes_per_param_masters_on_disk": masters["host_bytes_per_param"],
            "exact": same,
            "exact_masters_on_disk": same_masters,
            "raw": raw, "fractions": fractions, "state_in_ram": in_ram, "state_on_disk": on_disk,
            "masters_and_state_on_disk": masters,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    if not (same and same_masters):
        sys.exit("the disk tier's results differ from the RAM-resident optimizer's")


if __name__ == "__main__":
    main()
