"""``--device``, read the same way by every command and script that computes.

Checked while the arguments are parsed, before a model is read or a rate measured: otherwise a
CPU-only build fails on the first CUDA call with "Torch not compiled with CUDA enabled", and a
``meta`` or ``mps`` device fails deep inside the first step.
"""

from __future__ import annotations

import argparse

import torch


def device_argument(text: str) -> torch.device:
    """``text`` as ``cpu``, ``cuda`` or ``cuda:N`` of this machine: an ``argparse`` ``type=``.

    Raises:
        argparse.ArgumentTypeError: not a device name, a device other than the CPU or CUDA, CUDA
            where this machine has none, or an index past its CUDA devices; argparse prints the
            message and exits with status 2.
    """
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text} is not a device: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: the layers compute on cpu, cuda or cuda:N, not {device.type}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA device; use --device cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s), cuda:0 to "
                                             f"cuda:{count - 1}")
    return device
