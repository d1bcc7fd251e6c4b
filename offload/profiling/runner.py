"""Run several modes one after another in this process, each starting from the same memory.

Holds :func:`profile_modes` and :class:`ModeFailed`: it checks the request, says per figure group
what can be measured here and how (or why not), runs one unmeasured warm-up step, then each mode
in turn, and frees what a mode left before the next one begins. Running and measuring one mode is
:mod:`offload.profiling.measure`; the figures it returns are :mod:`offload.profiling.results`.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..planning.presets import Preset, check_trainable
from ..streams.trim import give_back_freed_memory
from .formatting import error_reason
from .measure import OPTIMIZERS, empty_result, finish_notes, run_mode
from .modes import Mode
from .nvml import open_nvml
from .results import ModeResult, Profile
from .sampler import MemorySampler


class ModeFailed(RuntimeError):
    """A mode raised something other than running out of memory; the message names the mode."""


def profile_modes(build: Callable[[], Preset], modes: Sequence[Mode], device: torch.device | str,
                  steps: int = 3, batch_size: int | None = None, optimizer: str = "adamw", lr: float = 1e-4,
                  sample_interval_s: float = 0.005, progress: Callable[[str], None] | None = None) -> Profile:
    """Train ``build()``'s model for ``steps`` steps in each mode and measure each.

    ``build`` is called once per mode, so every mode starts from a freshly built model (presets
    build the same weights every time) and nothing of one mode outlives it; it is called once
    more before that, for one unmeasured warm-up step of the first mode: that first build is
    checked before anything is measured, and names the profile even when every mode runs out of
    memory. A mode that runs out of device memory is reported as such and the next one runs.

    Args:
        build: returns a :class:`~offload.planning.presets.Preset`, e.g. ``lambda: build_preset("mlp")``.
        modes: what to run, in order.
        device: compute device.
        steps: training steps per mode.
        batch_size: rows per step; the preset's own when ``None``.
        optimizer: ``"adamw"`` or ``"sgd"``, stepped as a fused ``torch.optim`` optimizer over
            ``model.parameters()``. AdamW's state (two tensors per parameter) lives where the
            parameters live: on the device when resident, on the host when offloaded.
        sample_interval_s: seconds between the background thread's memory samples.
        progress: called with one line per mode and step.

    Raises:
        ValueError: no modes, a mode of unknown kind, ``steps < 1``, an unknown optimizer, a
            ``sample_interval_s`` that is not positive (0, negative, nan) or is past
            ``threading.TIMEOUT_MAX``, a device that is neither CUDA nor the CPU, or not here
            (:func:`check_device`), or a first build whose model has no parameter to train
            (:func:`~offload.planning.presets.check_trainable`).
        ModeFailed: a mode raised an error other than out-of-memory.
    """
    device = check_device(device)
    _check_arguments(modes, steps, optimizer, sample_interval_s)
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    nvml, figures, unavailable = _what_is_measured(device, sample_interval_s)
    report = progress or (lambda line: None)
    runs: list[ModeResult] = []
    try:
        with MemorySampler(device, nvml, sample_interval_s) as sampler:
            description, rows = _warm_up(build, modes[0], device, batch_size, optimizer, lr, sampler)
            for number, mode in enumerate(modes, 1):
                _reset_memory(device)
                where = f"[{number}/{len(modes)}] {mode.label}"
                result = empty_result(mode)
                try:
                    built, rows = run_mode(build, mode, result, device, steps, batch_size, optimizer, lr,
                                           sampler, lambda text, where=where: report(f"{where}: {text}"))
                    description, batch_size = description or built, batch_size or rows
                except Exception as error:
                    if not _out_of_memory(error):
                        raise ModeFailed(f"mode '{mode.label}' failed: {error_reason(error)}") from error
                    # A mode that does not fit is a result, not a failure: report it and go on.
                    result.error = "out of memory"
                    result.notes["error"] = error_reason(error)
                    report(f"{where}: out of memory ({error_reason(error)})")
                finish_notes(result, cuda, nvml is not None)
                runs.append(result)
                _reset_memory(device)
                sampler.sample()  # the end of the teardown: what the mode gave back
                sampler.pause()
    finally:
        if nvml is not None:
            nvml.close()
    return Profile(description or "model", str(device), batch_size or rows or 0, steps, OPTIMIZERS[optimizer][0],
                   runs, list(sampler.samples), figures, unavailable)


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a :class:`torch.device`, if the profiler can measure on it here.

    Checked before anything runs: otherwise a CPU-only build fails on the first CUDA call with
    "Torch not compiled with CUDA enabled", and a meta or other device fails inside the first mode.

    Raises:
        ValueError: not a device name, a device other than ``cuda``, ``cuda:N`` or ``cpu``, CUDA
            where it is not available, or a CUDA index past the devices there are.
    """
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {str(device)!r}; use cuda, cuda:N or cpu") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"cannot profile on device {str(device)!r}: use cuda, cuda:N or cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} was requested, but CUDA is not available here; use cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r} was requested, but there are {torch.cuda.device_count()} "
                         "CUDA devices")
    return device


def _check_arguments(modes: Sequence[Mode], steps: int, optimizer: str, sample_interval_s: float) -> None:
    if not modes:
        raise ValueError("no modes to profile")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    # The sampler's thread waits this long between samples: at 0 or below, or nan, the wait returns at
    # once and the thread spins; past TIMEOUT_MAX (inf) the wait overflows and the thread dies.
    if isinstance(sample_interval_s, bool) or not isinstance(sample_interval_s, (int, float)) \
            or not 0 < sample_interval_s <= threading.TIMEOUT_MAX:
        raise ValueError(f"sample_interval_s must be a positive number of seconds, at most "
                         f"{threading.TIMEOUT_MAX:.3g}; got {sample_interval_s!r}")
    for mode in modes:
        empty_result(mode)  # an unknown kind fails here, before anything runs


def _what_is_measured(device: torch.device, sample_interval_s: float) -> tuple[Any, dict[str, str], dict[str, str]]:
    """The NVML reader (or ``None``), a line per figure group saying how it is measured, and a
    line per group that cannot be measured here saying why."""
    cuda = device.type == "cuda"
    figures, unavailable = {}, {}
    if cuda:
        figures["device"] = f"torch.cuda allocator peaks on {device} ({torch.cuda.get_device_name(device)})"
    else:
        unavailable["device"] = f"device is {device.type}"
        figures["device"] = f"unavailable ({unavailable['device']})"
    nvml, figures["nvml"] = open_nvml(device)
    if nvml is None:
        unavailable["nvml"] = figures["nvml"]
    figures["host_rss"] = f"psutil process RSS, sampled every {sample_interval_s * 1e3:g} ms and at phase boundaries"
    if cuda:
        figures["host_pinned"] = ("bytes of OffloadModel's pinned host buffers (parameters and their compute-dtype "
                                  "copies, gradients, boundary activations)")
    else:
        unavailable["host_pinned"] = "host buffers are pinned only for a CUDA device"
        figures["host_pinned"] = "not pinned (CPU device)"
    return nvml, figures, unavailable


def _out_of_memory(error: BaseException) -> bool:
    """Device out-of-memory, or the host allocator failing (offloading moves memory to the host)."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, (RuntimeError, MemoryError)) and (
        isinstance(error, MemoryError) or "can't allocate memory" in text or "out of memory" in text.lower()
    )


def _warm_up(build: Callable[[], Preset], mode: Mode, device: torch.device, batch_size: int | None,
             optimizer_name: str, lr: float, sampler: MemorySampler) -> tuple[str | None, int | None]:
    """One unmeasured step of ``mode`` before anything is measured; returns the description of
    the model ``build`` made and the rows of its batch (``None`` if building failed), which name
    the profile even when every mode runs out of memory.

    The first mode would otherwise pay one-time costs the others do not: the first optimizer
    imports a good part of PyTorch (about 80 MiB of RSS), the first kernels of each shape are
    selected, the heap grows to its working size and, on CUDA, the context and library handles
    are created.

    Raises:
        ValueError: the model has no parameter to train (:func:`~offload.planning.presets.check_trainable`).
    """
    description = rows = None
    try:
        preset = build()
    except Exception:
        preset = None  # the measured run of this mode builds again, fails the same way, and reports it
    if preset is not None:
        # Refused here, not as the first mode's failure: every mode would fail the same way.
        check_trainable(preset.model, "build() returned a preset whose model is")
        description, rows = f"{preset.name}: {preset.description}", batch_size or preset.batch_size
        try:
            run_mode(lambda: preset, mode, empty_result(mode), device, 1, batch_size, optimizer_name, lr, sampler,
                     lambda line: None)
        except Exception:
            pass  # the measured run of this mode fails the same way, and reports it
        del preset
    sampler.discard()
    _reset_memory(device)
    return description, rows


def _reset_memory(device: torch.device) -> None:
    """Free what the previous mode left, so the next one starts from the same memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # Freed pinned blocks stay cached by PyTorch's host allocator and would count in the next
        # mode's RSS; there is no public call to release them.
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # glibc keeps freed heap memory mapped, so RSS would not fall between modes without this.
    give_back_freed_memory()
