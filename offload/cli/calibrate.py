"""``python -m offload calibrate``: measure this machine's rates for the planner, in about a minute.

What it measures (each the median of a few repeats, after one to warm up):

- the host's copy bandwidth (a large ``copy_`` in RAM), and its memory bandwidth (a copy of a
  few GB between two buffers, as STREAM's copy: :func:`host_memory_bandwidth`);
- the fused AdamW update on the host, as ``OffloadOptimizer`` runs it;
- with CUDA: pinned copies over the link each way, and the device's matmul rate in float32 and
  bfloat16; without it, the CPU's own matmul rate (the CPU is then the "device", and the file's
  link rates are 0: ``offload plan`` takes it for ``--device cpu``, or for a GPU given with
  ``--gpu``, whose link rates replace them);
- with ``--dir``: sequential write (with ``fsync``) and read of a file there, its pages dropped
  from the cache before the read where the platform allows;
- the fixed host cost of one slice run, from an ``OffloadModel`` of tiny layers cut into one
  slice and into many.

It writes a :class:`~offload.planning.rates.MachineRates` as JSON (``--out``, default
:func:`~offload.planning.rates.default_rates_path`), which ``offload plan`` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..model import OffloadModel
from ..planning.rates import ADAMW_BYTES_PER_PARAMETER, MachineRates, default_rates_path, save_rates
from ..profiling.outputs import check_output_path
from .device_argument import device_argument
from .finetune_args import user_path
from .plan import OneLineParser, check_disk_dir


def _median_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_copy_rate(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes copied per second by one large copy in RAM."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    return nbytes / _median_seconds(copy, repeats)


def host_memory_bandwidth(nbytes: int = 1 << 30, repeats: int = 7, num_threads: int | None = None) -> float:
    """Bytes per second the host's memory reads plus writes: the median of ``repeats`` copies of
    ``nbytes`` between two buffers (each larger than any cache), counted as STREAM's copy counts
    them (``2 * nbytes`` a copy).

    Args:
        num_threads: CPU threads the copy may use, as the update worker's (``OffloadOptimizer``'s
            ``num_threads``); ``None``: PyTorch's setting.
    """
    if nbytes < 1 or repeats < 1 or (num_threads is not None and num_threads < 1):
        raise ValueError(f"host_memory_bandwidth needs positive nbytes, repeats and num_threads, got "
                         f"{nbytes}, {repeats}, {num_threads}")
    src = torch.ones(nbytes // 4)
    dst = torch.zeros_like(src)  # touched: the first copy does not time the pages' first faults
    before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        seconds = _median_seconds(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(before)
    return 2 * src.numel() * src.element_size() / seconds


def host_norm_rate(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second a float32 tensor's 2-norm reads on the host, as ``clip_grad_norm_``
    computes each gradient's (``torch.linalg.vector_norm``: one thread for a CPU tensor)."""
    values = torch.randn(nbytes // 4)
    return nbytes / _median_seconds(lambda: torch.linalg.vector_norm(values, 2.0), repeats)


def host_update_rate(parameters: int = 8_000_000, repeats: int = 5) -> float:
    """Fused AdamW on the host, in :data:`ADAMW_BYTES_PER_PARAMETER` bytes per parameter per second."""
    params = [nn.Parameter(torch.randn(parameters // 8)) for _ in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    return ADAMW_BYTES_PER_PARAMETER * parameters / _median_seconds(optimizer.step, repeats)


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    """Dense ``size x size`` matrix products per second on ``device``, in floating-point operations."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def product() -> None:
        torch.mm(a, b)

    return 2 * size**3 / _median_seconds(product, repeats, sync)


def link_rates(device: torch.device, nbytes: int = 256 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """Pinned copies host to device and device to host, bytes per second."""
    host = torch.empty(nbytes // 4, pin_memory=True)
    on_device = torch.empty(nbytes // 4, device=device)

    def sync() -> None:
        torch.cuda.synchronize(device)  # the copies are asynchronous: time them done

    def load() -> None:
        on_device.copy_(host, non_blocking=True)

    def offload() -> None:
        host.copy_(on_device, non_blocking=True)

    return nbytes / _median_seconds(load, repeats, sync), nbytes / _median_seconds(offload, repeats, sync)


def disk_rates(directory: Path, nbytes: int = 256 * 2**20) -> tuple[float, float]:
    """Sequential write (``fsync`` included) and read of one file in ``directory``, bytes per second."""
    # Only the last level, as a DiskTier makes it: a mistyped path measures no other disk.
    directory.mkdir(exist_ok=True)
    block = os.urandom(4 * 2**20)
    with tempfile.NamedTemporaryFile(dir=directory, prefix="offload-calibrate-") as handle:
        start = time.perf_counter()
        for _ in range(nbytes // len(block)):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
        write = nbytes / (time.perf_counter() - start)
        if hasattr(os, "posix_fadvise"):
            # Drop the pages just written: a read from the page cache would time RAM, not the disk.
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with open(handle.name, "rb", buffering=0) as reader:
            start = time.perf_counter()
            while reader.read(8 * 2**20):
                pass
            read = nbytes / (time.perf_counter() - start)
    return read, write


def slice_overhead(slices: int = 16, repeats: int = 5) -> float:
    """Host seconds per slice run: a step of tiny layers in ``slices`` slices against one slice."""
    def step_seconds(num_slices: int) -> float:
        torch.manual_seed(0)
        model = OffloadModel(nn.Sequential(*[nn.Linear(8, 8) for _ in range(slices)]), device="cpu",
                             num_slices=num_slices)
        x = torch.randn(4, 8)
        return _median_seconds(lambda: model(x).sum().backward(), repeats)

    many, one = step_seconds(slices), step_seconds(1)
    # Each slice runs three times a step: forward, recompute, backward.
    return max(0.0, (many - one) / (3 * (slices - 1)))


def calibrate(directory: Path | None = None, device: torch.device | None = None) -> MachineRates:
    """Measure this machine's :class:`~offload.planning.rates.MachineRates`."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    host = f"{platform.node() or 'this host'} ({os.cpu_count()} cores)"
    copy = host_copy_rate()
    host_memory = host_memory_bandwidth()
    sources = {"host_copy": "calibrate: copy_ of 256 MiB", "host_update": "calibrate: fused AdamW, 8 M parameters",
               "host_memory_bandwidth": "calibrate: copy_ of 1 GiB, median of 7, read plus written",
               "slice_overhead_s": "calibrate: 16 tiny slices against one",
               "host_norm": "calibrate: vector_norm of 256 MiB of float32, median of 5"}
    if device.type == "cuda":
        name = f"{torch.cuda.get_device_name(device)} on {host}"
        flops = {"float32": matmul_rate(device, torch.float32, 8192), "bfloat16": matmul_rate(device, torch.bfloat16, 8192)}
        h2d, d2h = link_rates(device)
        memory = torch.cuda.get_device_properties(device).total_memory
        sources |= {"device_flops": "calibrate: 8192^2 matmul", "host_to_device": "calibrate: pinned 256 MiB",
                    "device_to_host": "calibrate: pinned 256 MiB"}
    else:
        name = f"CPU {host}"
        flops = {"float32": matmul_rate(device, torch.float32, 1024), "bfloat16": matmul_rate(device, torch.bfloat16, 1024)}
        # No link: a CPU "device"'s loads are copies in RAM, timed with host_copy. A link rate of 0
        # marks the file as a CPU device's, which `offload plan` refuses for a GPU (without --gpu).
        h2d = d2h = 0.0
        memory = None
        sources |= {"device_flops": "calibrate: 1024^2 matmul on the CPU",
                    "host_to_device": "calibrate: no link, the CPU is the device",
                    "device_to_host": "calibrate: no link, the CPU is the device"}
    read = write = None
    if directory is not None:
        read, write = disk_rates(directory)
        sources |= {"disk_read": f"calibrate: 256 MiB in {directory}", "disk_write": f"calibrate: 256 MiB in {directory}"}
    return MachineRates(name=f"calibrated: {name}", device_flops=flops, host_to_device=h2d, device_to_host=d2h,
                        host_copy=copy, host_update=host_update_rate(), disk_read=read, disk_write=write,
                        slice_overhead_s=slice_overhead(), device_memory=memory, host_memory_bandwidth=host_memory,
                        host_norm=host_norm_rate(), sources=sources)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, each checked before a minute of measuring: a device that is not here, a
    ``--dir`` a disk tier would refuse or an ``--out`` that cannot be written fails in a line."""
    parser = OneLineParser(prog="offload calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=user_path, default=default_rates_path(),
                        help="where to write the rates (default: %(default)s)")
    parser.add_argument("--dir", type=user_path, help="measure the disk here (where the disk tier would live)")
    parser.add_argument("--device", type=device_argument, help="cuda or cpu (default: cuda when present)")
    args = parser.parse_args(argv)
    if args.dir is not None:
        check_disk_dir(parser, args.dir, "--dir")
    try:
        check_output_path(args.out, "--out")
    except FileNotFoundError:
        # save_rates makes the missing folders (the default's on a first run): made now, then
        # probed, since only making them tells (os.access says yes to root under /proc).
        _make_out_directory(parser, args.out)
    except OSError as error:
        parser.error(str(error))
    return args


def _make_out_directory(parser: argparse.ArgumentParser, out: Path) -> None:
    """Make ``--out``'s missing folders and check that the file can be written in them, before the
    measuring; exits as the parser does, in one line, where they cannot be made or written."""
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        check_output_path(out, "--out")
    except OSError as error:
        existing = next(p for p in out.absolute().parents if p.exists())
        reason = error.strerror or str(error)
        parser.error(f"--out {out}: cannot make its directory under {existing} ({reason}); give a path in a "
                     "directory this process can write to")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        rates = calibrate(args.dir, args.device)
        path = _save(rates, args.out)
    except KeyboardInterrupt:
        # Like offload-finetune's Ctrl-C: one line, no traceback, exit status 128 + SIGINT.
        print(f"\noffload calibrate: interrupted; nothing written ({args.out} unchanged)", file=sys.stderr)
        raise SystemExit(130) from None
    _report(rates, path)


def _save(rates: MachineRates, out: Path) -> Path:
    """``save_rates``, whole or not at all (the old file stays on any failure); where it cannot
    (a full disk, after a minute of measuring), the rates go to stdout so the work is not lost."""
    try:
        return save_rates(rates, out)
    except OSError as error:
        print(json.dumps(rates.to_json(), indent=2))
        raise SystemExit(f"offload calibrate: error: cannot write --out {out} ({error.strerror or error}); the "
                         "measured rates are printed above: save them to a file and pass it as --rates, or free "
                         "space and run calibrate again") from None


def _report(rates: MachineRates, path: Path) -> None:
    gb = 1e9
    print(f"{rates.name}")
    print(f"  device matmul: " + ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s" for k, v in rates.device_flops.items()))
    if rates.host_to_device and rates.device_to_host:
        print(f"  link: {rates.host_to_device / gb:.1f} GB/s to the device, {rates.device_to_host / gb:.1f} GB/s back")
    else:
        print("  link: none, the CPU is the device (these rates plan --device cpu, or a GPU given with --gpu)")
    print(f"  host: copy {rates.host_copy / gb:.1f} GB/s, memory {rates.host_memory / gb:.1f} GB/s read plus "
          f"written, fused AdamW {rates.host_update / gb:.1f} GB/s "
          f"({rates.host_update / ADAMW_BYTES_PER_PARAMETER / 1e6:.0f} M parameters/s); "
          f"{rates.slice_overhead_s * 1e3:.2f} ms per slice run; a gradient's norm {rates.host_norm_rate / gb:.1f} "
          f"GB/s")
    if rates.disk_read is not None and rates.disk_write is not None:
        print(f"  disk: read {rates.disk_read / gb:.2f} GB/s, write {rates.disk_write / gb:.2f} GB/s")
    print(f"written to {path}")


if __name__ == "__main__":
    main()
