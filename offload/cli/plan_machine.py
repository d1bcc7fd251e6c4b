"""The machine ``offload plan`` plans for: its rates (``offload calibrate``'s file, a GPU's defaults,
or both), refused where they cannot time the device or the disk asked for, and its memory and disk
limits, from the flags or detected now. What it does not hold: the arguments' parsing and the
printed plan (``plan.py``), or the rates themselves (``offload/planning/rates.py``).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
from pathlib import Path

from ..planning.choose import Limits
from ..planning.rates import GPU_DEFAULTS, MachineRates, default_rates_path, load_rates
from .plan_models import PlanInputError, _one_line

GIB = 2**30


def machine_rates(args: argparse.Namespace) -> MachineRates:
    """The GPU's defaults with the calibrated host where there is a calibration, or the calibration."""
    path = args.rates or default_rates_path()
    try:
        calibrated = load_rates(path) if path.is_file() else None
    except (TypeError, ValueError) as error:  # not JSON, or fields of another version
        flag = "--rates" if args.rates is not None else "the rates file"
        reason = _one_line(error)
        if "calibrate" not in reason:
            reason += "; run `python -m offload calibrate` again" + ("" if args.gpu else ", or pass --gpu NAME")
        raise PlanInputError(f"{flag} {path}: {reason}") from error
    if args.gpu:
        if args.device == "cpu":  # the GPU's compute and link rates would time a CPU device
            raise PlanInputError(f"--gpu {args.gpu} plans that GPU, and --device cpu a CPU device, which its rates do "
                                 "not time: leave out --gpu for a CPU (with its calibration: `python -m offload "
                                 "calibrate --device cpu`), or --device cpu for the GPU")
        gpu = GPU_DEFAULTS[args.gpu]
        return gpu.with_host(calibrated) if calibrated is not None else gpu
    if calibrated is not None:
        if args.device == "cuda" and _of_a_cpu_device(calibrated):
            flag = "--rates" if args.rates is not None else "the rates file"
            raise PlanInputError(f"{flag} {path}: rates of a CPU device, no link rates (host_to_device, "
                                 f"device_to_host) to plan a GPU with: run `python -m offload calibrate` on the "
                                 f"GPU's machine, pass --gpu NAME, or plan --device cpu")
        if args.device == "cpu" and not _of_a_cpu_device(calibrated):
            # Its compute rates are a GPU's: a CPU's step would be timed at the GPU's speed.
            flag = "--rates" if args.rates is not None else "the rates file"
            raise PlanInputError(f"{flag} {path}: rates of a GPU ({calibrated.name}), which time no CPU device: run "
                                 f"`python -m offload calibrate --device cpu --out FILE` and pass --rates FILE, or "
                                 f"plan --device cuda")
        return calibrated
    if args.device == "cpu":
        # The host's defaults have no compute rate: a CPU's own must be measured.
        raise PlanInputError(f"--device cpu needs this CPU's compute rates: run `python -m offload calibrate "
                             f"--device cpu` (writes {path}), or pass --rates FILE")
    raise PlanInputError(f"no rates: run `python -m offload calibrate` on the machine (writes {path}), or pass "
                         f"--gpu {{{','.join(sorted(GPU_DEFAULTS))}}}")


def _of_a_cpu_device(rates: MachineRates) -> bool:
    """Whether ``rates`` are a CPU "device"'s, which time no GPU: a link rate of 0 (no link, as
    ``offload calibrate`` writes for a CPU), or the name ``offload calibrate`` gives a CPU's rates
    (files it wrote before it wrote 0 gave the host's copy rate as the link's). A GPU's loads would
    take no time, divide by 0, or go at the speed of a copy in RAM."""
    no_link = not (rates.host_to_device and rates.device_to_host)
    return no_link or rates.name.startswith("calibrated: CPU ")


def check_disk_rates(args: argparse.Namespace, rates: MachineRates) -> None:
    """Refuse ``--disk-dir`` with rates that time no disk: a calibration without ``--dir`` leaves
    them null, and the tier's reads and writes could not be timed."""
    if args.disk_dir is None or (rates.disk_read is not None and rates.disk_write is not None):
        return
    # Only a calibration leaves them out (the host's defaults give them): the rates came from a file.
    path = args.rates or default_rates_path()
    flag = "--rates" if args.rates is not None else "the rates file"
    out = f" --out {shlex.quote(str(path))}" if args.rates is not None else ""
    raise PlanInputError(f"{flag} {path}: no disk rates (disk_read, disk_write) to plan a disk tier with: run "
                         f"`python -m offload calibrate --dir {shlex.quote(str(args.disk_dir))}{out}`, or leave "
                         f"out --disk-dir")


def machine_limits(args: argparse.Namespace, rates: MachineRates) -> Limits:
    import psutil

    device = args.device_memory * GIB if args.device_memory is not None else rates.device_memory
    host = args.host_memory * GIB if args.host_memory is not None else psutil.virtual_memory().available
    disk = None
    if args.disk_dir is not None:
        disk = args.disk * GIB if args.disk is not None else shutil.disk_usage(_existing(Path(args.disk_dir))).free
    pinned = None if args.pinned_memory is None else int(args.pinned_memory * GIB)
    return Limits(device_memory=None if device is None else int(device), host_memory=int(host),
                  disk=None if disk is None else int(disk), disk_dir=args.disk_dir, pinned_memory=pinned)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
