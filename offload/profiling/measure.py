"""Run one mode and measure it: build the model, train it step by step, fill in a :class:`ModeResult`.

Each phase (forward, backward, optimizer step) is timed with the device synchronised at its
boundaries, marked in the sampler, and summarised into :class:`PhaseFigures`: sampled RSS and NVML
peaks, exact allocator peaks, and the bytes OffloadModel holds, read from its public
:meth:`~offload.OffloadModel.memory_footprint`. What this file does not do: run several modes,
warm up, or free memory between modes (:mod:`offload.profiling.runner`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..model import OffloadModel
from ..planning.presets import Preset
from .formatting import format_size
from .modes import Mode
from .results import PHASES, ModeResult, PhaseFigures
from .sampler import MemorySampler

# fused=True: on host parameters the per-tensor default is 4-7x slower (docs/optimizer.md), and warns.
OPTIMIZERS: dict[str, tuple[str, Callable[[Any, float], torch.optim.Optimizer]]] = {
    "adamw": ("AdamW", lambda params, lr: torch.optim.AdamW(params, lr=lr, fused=True)),
    "sgd": ("SGD", lambda params, lr: torch.optim.SGD(params, lr=lr, fused=True)),
}


def empty_result(mode: Mode) -> ModeResult:
    """The result of ``mode`` before it runs: its settings, no figures.

    Raises:
        ValueError: ``mode`` is of an unknown kind.
    """
    if mode.kind == "resident":
        return ModeResult(mode.kind, mode.label)
    if mode.kind == "offload":
        return ModeResult(mode.kind, mode.label, mode.num_slices, mode.num_microbatches, mode.checkpoint_activation,
                          None if mode.compute_dtype is None else str(mode.compute_dtype).removeprefix("torch."))
    raise ValueError(f"unknown mode kind {mode.kind!r}; use 'resident' or 'offload'")


def run_mode(build: Callable[[], Preset], mode: Mode, result: ModeResult, device: torch.device, steps: int,
             batch_size: int | None, optimizer_name: str, lr: float, sampler: MemorySampler,
             progress: Callable[[str], Any]) -> tuple[str, int]:
    """Run and measure one mode into ``result``; returns the preset's description and the batch size."""
    cuda = device.type == "cuda"
    start = sampler.begin_mode(mode.label)
    result.host_rss_start_bytes, result.nvml_start_used_bytes = start.host_rss_bytes, start.nvml_used_bytes

    preset = build()
    rows = batch_size or preset.batch_size
    result.parameter_bytes = preset.parameter_bytes
    if mode.kind == "offload":
        offloaded = OffloadModel(preset.model, device=device, num_slices=mode.num_slices,
                                 num_microbatches=mode.num_microbatches,
                                 checkpoint_activation=mode.checkpoint_activation, compute_dtype=mode.compute_dtype)
        # The slices that run: OffloadModel clamps num_slices to the layer count (with a warning).
        result.num_slices = len(offloaded.partition)
        result.label = mode.label_ran(result.num_slices)
        sampler.relabel(result.label)
        model: torch.nn.Module = offloaded
    else:
        model = preset.model.to(device)
    optimizer = OPTIMIZERS[optimizer_name][1](model.parameters(), lr)
    inputs, target = preset.make_batch(rows, device)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)

    times: dict[str, list[float]] = {p: [] for p in PHASES}
    figures = {p: PhaseFigures() for p in PHASES}
    for step in range(1, steps + 1):
        loss = None
        for phase in PHASES:
            with _phase(sampler, device, step, phase, times[phase], figures[phase]):
                if phase == "forward":
                    loss = preset.loss(model(inputs), target)
                elif phase == "backward":
                    loss.backward()
                else:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            if isinstance(model, OffloadModel):
                _record_host_buffers(model, result, figures[phase])
        del loss
        step_time = sum(times[p][-1] for p in PHASES)
        result.step_times_s.append(step_time)
        progress(_progress_line(step, steps, step_time, figures.values()))

    _summarise(result, figures, times, mode, cuda)
    sampler.mark(steps, "teardown")
    return f"{preset.name}: {preset.description}", rows


def _summarise(result: ModeResult, figures: dict[str, PhaseFigures], times: dict[str, list[float]], mode: Mode,
               cuda: bool) -> None:
    """Fill in ``result``'s figures for the whole mode once its steps ran: each phase's typical time
    (the first step, which warms up, left out), each peak the highest of its phases', and what the
    caching host allocator holds pinned."""
    for phase in PHASES:
        figures[phase].time_s = _typical(times[phase])
    result.phases = figures
    result.step_time_s = _typical(result.step_times_s)
    for name in ("device_peak_allocated_bytes", "device_peak_reserved_bytes", "nvml_peak_used_bytes",
                 "host_rss_peak_bytes", "host_pinned_bytes"):
        values = [getattr(f, name) for f in figures.values() if getattr(f, name) is not None]
        setattr(result, name, max(values) if values else None)
    if mode.kind == "resident":
        result.host_pinned_bytes = 0
    host_memory_stats = getattr(torch.cuda, "host_memory_stats", None)  # PyTorch 2.5 and later
    if cuda and host_memory_stats is not None:
        result.host_pinned_allocator_bytes = host_memory_stats().get("allocated_bytes.current")


def finish_notes(result: ModeResult, cuda: bool, nvml: bool) -> None:
    """Say in ``result.notes`` why a figure is ``None`` or 0."""
    if not cuda:
        for name in ("device_peak_allocated_bytes", "device_peak_reserved_bytes"):
            result.notes[name] = "unavailable (device is cpu)"
    if not nvml:
        for name in ("nvml_start_used_bytes", "nvml_peak_used_bytes"):
            result.notes[name] = "NVML unavailable (see figures.nvml)"
    if result.mode == "resident":
        result.notes["host_pinned_bytes"] = "the resident model holds no host buffers"
    elif not cuda:
        result.notes["host_pinned_bytes"] = "not pinned (CPU device)"


def host_buffer_bytes(model: OffloadModel) -> dict[str, int | bool]:
    """:meth:`OffloadModel.memory_footprint() <offload.OffloadModel.memory_footprint>` as a dict.

    Kept for callers of the dict; new code reads the :class:`~offload.MemoryFootprint` directly.

    Returns:
        ``model`` (host copies of parameters and buffers), ``shadow`` (their copies in the
        compute dtype, with ``compute_dtype``), ``pool`` (pooled host buffers for gradients and
        boundary activations), ``slots`` (device slots), and ``pinned`` (whether the host buffers
        are pinned: only with a CUDA device).
    """
    footprint = model.memory_footprint()
    return {
        "model": footprint.host_copies,
        "shadow": footprint.host_shadows,
        "pool": footprint.host_pool,
        "slots": footprint.device_slots,
        "pinned": footprint.pinned,
    }


@contextmanager
def _phase(sampler: MemorySampler, device: torch.device, step: int, phase: str, times: list[float],
           figures: PhaseFigures) -> Iterator[None]:
    cuda = device.type == "cuda"
    if cuda:
        # Work queued by the previous phase must finish before this one's clock and peak start.
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    first = len(sampler.samples)
    sampler.mark(step, phase)
    start = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize(device)  # the phase's kernels and copies are part of its time
    times.append(time.perf_counter() - start)
    sampler.sample()
    samples = [s for s in sampler.samples[first:] if s.step == step and s.phase == phase]
    figures.host_rss_peak_bytes = _max(figures.host_rss_peak_bytes, max(s.host_rss_bytes for s in samples))
    nvml = [s.nvml_used_bytes for s in samples if s.nvml_used_bytes is not None]
    if nvml:
        figures.nvml_peak_used_bytes = _max(figures.nvml_peak_used_bytes, max(nvml))
    if cuda:
        figures.device_peak_allocated_bytes = _max(figures.device_peak_allocated_bytes,
                                                   torch.cuda.max_memory_allocated(device))
        figures.device_peak_reserved_bytes = _max(figures.device_peak_reserved_bytes,
                                                  torch.cuda.max_memory_reserved(device))


def _record_host_buffers(model: OffloadModel, result: ModeResult, figures: PhaseFigures) -> None:
    footprint = model.memory_footprint()
    result.host_model_bytes = footprint.host_copies + footprint.host_shadows
    result.host_pool_peak_bytes = _max(result.host_pool_peak_bytes, footprint.host_pool)
    result.device_slot_bytes = footprint.device_slots
    figures.host_pinned_bytes = _max(figures.host_pinned_bytes, footprint.pinned_bytes)


def _progress_line(step: int, steps: int, step_time: float, figures: Iterable[PhaseFigures]) -> str:
    figures = list(figures)
    line = f"step {step}/{steps} {step_time * 1e3:.0f} ms"
    device = [f.device_peak_allocated_bytes for f in figures if f.device_peak_allocated_bytes is not None]
    if device:
        line += f", device peak allocated {format_size(max(device))}"
    return line + f", host RSS peak {format_size(max(f.host_rss_peak_bytes or 0 for f in figures))}"


def _typical(values: Sequence[float]) -> float | None:
    if not values:
        return None
    return statistics.median(values[1:] if len(values) > 1 else values)


def _max(current: int | None, new: int) -> int:
    return new if current is None else max(current, new)
