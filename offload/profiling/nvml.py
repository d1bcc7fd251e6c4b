"""NVML's view of a GPU's memory: the device-used bytes of every process, the CUDA context included.

Holds :class:`NvmlMemory` (one GPU's reader) and :func:`open_nvml`, which finds the GPU or says why
it cannot. ``pynvml`` is imported only inside :func:`open_nvml`, so the package imports where it is
missing. Sampling the reader over time is :mod:`offload.profiling.sampler`'s job, not this file's.
"""

from __future__ import annotations

from typing import Any

import torch

from .formatting import error_reason


class NvmlMemory:
    """Device-used memory of one GPU as NVML reports it (every process, the CUDA context included)."""

    def __init__(self, pynvml: Any, handle: Any) -> None:
        self._pynvml = pynvml
        self._handle = handle

    def used_bytes(self) -> int | None:
        try:
            return int(self._pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        except Exception:  # a transient NVML error loses one sample, not the run
            return None

    def close(self) -> None:
        try:
            self._pynvml.nvmlShutdown()
        except Exception:
            pass


def open_nvml(device: torch.device | str) -> tuple[NvmlMemory | None, str]:
    """NVML's view of ``device``, or ``None`` and why not. Never raises.

    ``pynvml`` (from ``nvidia-ml-py``) is imported here, not at module import, so the package
    works where it is missing; a missing NVML library (no driver) is reported the same way.

    Returns:
        The reader (or ``None``) and a line saying what is measured, or ``"NVML unavailable: ..."``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None, f"NVML unavailable: device is {device.type}, NVML measures GPUs"
    try:
        import pynvml
    except ImportError as error:
        return None, f"NVML unavailable: cannot import pynvml ({error}); pip install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except Exception as error:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None, f"NVML unavailable: {error_reason(error)}"
    try:
        handle, how = _nvml_handle(pynvml, device)
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception as error:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
        return None, f"NVML unavailable: {error_reason(error)}"
    return NvmlMemory(pynvml, handle), f"NVML device-used memory of {device} ({how}), every process included"


def _nvml_handle(pynvml: Any, device: torch.device) -> tuple[Any, str]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    # CUDA and NVML number GPUs differently under CUDA_VISIBLE_DEVICES; the UUID names one GPU for both.
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    if uuid:
        name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(name), f"matched by UUID {name}"
        except Exception:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(index), f"matched by index {index}"
