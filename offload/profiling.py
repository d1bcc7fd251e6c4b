"""Measure what a training step costs in device memory, host memory and time, per configuration.

:func:`profile_modes` trains the same model on the same input in several *modes*, one after
another in this process: ``resident`` (the plain model on the device) and ``offload``
configurations of :class:`~offload.OffloadModel`. Between modes the previous model and optimizer
are freed and the device allocator is emptied, so each mode starts from the same memory. Per mode
and per phase (forward, backward, optimizer step) it records:

- device: the CUDA caching allocator's peak allocated and reserved bytes, and the device-used
  memory NVML reports (which also sees the CUDA context and memory PyTorch does not allocate);
- host: the process's resident set size (RSS), and the bytes of the model's pinned host buffers;
- time: each phase, with the device synchronised at phase boundaries so the time belongs to it.

NVML and RSS are sampled by a background thread (every few milliseconds, and at every phase
boundary); allocator peaks are exact. A figure that cannot be measured here (no CUDA device, no
NVML library) is ``None`` with the reason in :attr:`Profile.unavailable`; nothing raises for it.

This file measures and reports (table, JSON, CSV, plot). Models and inputs come from
:mod:`offload.presets`; the command line is ``scripts/profile_memory.py``.

Example::

    >>> from offload.presets import build_preset
    >>> from offload.profiling import Mode, profile_modes
    >>> profile = profile_modes(lambda: build_preset("mlp"), [Mode.resident(), Mode.offload(4)], device="cuda")
    >>> print(profile.table())
"""

from __future__ import annotations

import csv
import ctypes
import gc
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import torch

from .model import OffloadModel
from .presets import Preset

PHASES = ("forward", "backward", "optimizer")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``"100000"``, ``"512MiB"``, ``"2GiB"``, ``"1.5GB"`` (GB = 10**9, GiB = 2**30).

    Raises:
        ValueError: ``text`` is not a non-negative number with an optional known unit.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; use bytes (100000) or a number with a unit "
                         "(512MiB, 2GiB, 1.5GB)")
    return round(float(match.group(1)) * _UNITS[unit])


def format_size(nbytes: int | float | None) -> str:
    """``nbytes`` in GiB, MiB or KiB, e.g. ``"1.25 GiB"``; ``"n/a"`` for ``None``."""
    if nbytes is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}" if unit == "GiB" else f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


# -- what runs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    """One way to run the model.

    Attributes:
        kind: ``"resident"`` (the plain model on the device, in its own dtype) or ``"offload"``
            (wrapped in :class:`~offload.OffloadModel` with the settings below, which are its
            arguments of the same names; ignored for ``resident``).
    """

    kind: str
    num_slices: int = 1
    num_microbatches: int = 1
    checkpoint_activation: bool = True
    compute_dtype: torch.dtype | None = None

    @classmethod
    def resident(cls) -> Mode:
        return cls("resident")

    @classmethod
    def offload(cls, num_slices: int = 3, num_microbatches: int = 1, checkpoint_activation: bool = True,
                compute_dtype: torch.dtype | None = None) -> Mode:
        return cls("offload", num_slices, num_microbatches, checkpoint_activation, compute_dtype)

    @property
    def label(self) -> str:
        if self.kind == "resident":
            return "resident"
        checkpoint = "on" if self.checkpoint_activation else "off"
        precision = f" {_DTYPE_NAMES[self.compute_dtype]}" if self.compute_dtype is not None else ""
        return f"offload slices={self.num_slices} mb={self.num_microbatches} ckpt={checkpoint}{precision}"


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def offload_modes(slices: Sequence[int], microbatches: Sequence[int] = (1,), checkpoint: Sequence[bool] = (True,),
                  compute_dtypes: Sequence[torch.dtype | None] = (None,)) -> list[Mode]:
    """Every combination of the given offload settings, in order."""
    return [Mode.offload(s, m, c, d) for s in slices for m in microbatches for c in checkpoint for d in compute_dtypes]


# -- NVML -----------------------------------------------------------------------------------------------


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
        return None, f"NVML unavailable: {_reason(error)}"
    try:
        handle, how = _nvml_handle(pynvml, device)
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    except Exception as error:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
        return None, f"NVML unavailable: {_reason(error)}"
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


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# -- sampling -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """Memory at one moment of one mode; ``None`` where the figure is unavailable."""

    label: str
    step: int
    phase: str
    time_s: float
    host_rss_bytes: int
    nvml_used_bytes: int | None
    device_allocated_bytes: int | None
    device_reserved_bytes: int | None


class MemorySampler:
    """A background thread that samples RSS, NVML and the allocator, labelled with what runs.

    The main thread calls :meth:`mark` at each phase boundary, which also takes a sample, so a
    phase shorter than the interval still has its start and end.

    Args:
        device: the compute device (allocator figures only for CUDA).
        nvml: NVML reader, or ``None``.
        interval_s: seconds between background samples.
    """

    def __init__(self, device: torch.device, nvml: NvmlMemory | None, interval_s: float) -> None:
        self.device = device
        self.nvml = nvml
        self.interval_s = interval_s
        self.samples: list[Sample] = []
        self._process = psutil.Process()
        # One lock orders label changes and samples, so a sample is never filed under a phase
        # that had already ended when it was read.
        self._lock = threading.Lock()
        self._label, self._step, self._phase, self._start = "", 0, "setup", time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="offload-memory-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def begin_mode(self, label: str) -> Sample:
        with self._lock:
            self._label, self._step, self._phase, self._start = label, 0, "setup", time.perf_counter()
            return self._take()

    def mark(self, step: int, phase: str) -> Sample:
        """Start ``phase`` of ``step``; returns the sample taken now."""
        with self._lock:
            self._step, self._phase = step, phase
            return self._take()

    def pause(self) -> None:
        """Stop background sampling until the next mode begins."""
        with self._lock:
            self._label = ""

    def discard(self) -> None:
        """Forget every sample so far and pause."""
        with self._lock:
            self.samples.clear()
            self._label = ""

    def sample(self) -> Sample:
        with self._lock:
            return self._take()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                if self._label:  # nothing is measured before the first mode begins
                    self._take()

    def _take(self) -> Sample:
        allocated = reserved = None
        if self.device.type == "cuda":
            # One read of the nested statistics: memory_allocated() and memory_reserved() would
            # each build and flatten the whole table.
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)  # empty before CUDA initialises
            allocated = stats.get("allocated_bytes", {}).get("all", {}).get("current", 0)
            reserved = stats.get("reserved_bytes", {}).get("all", {}).get("current", 0)
        sample = Sample(
            self._label, self._step, self._phase, time.perf_counter() - self._start,
            self._process.memory_info().rss,
            self.nvml.used_bytes() if self.nvml is not None else None,
            allocated, reserved,
        )
        self.samples.append(sample)
        return sample


# -- results --------------------------------------------------------------------------------------------


@dataclass
class PhaseFigures:
    """Peaks and time of one phase, over every step (time: median over steps)."""

    time_s: float | None = None
    device_peak_allocated_bytes: int | None = None
    device_peak_reserved_bytes: int | None = None
    nvml_peak_used_bytes: int | None = None
    host_rss_peak_bytes: int | None = None
    host_pinned_bytes: int | None = None


@dataclass
class ModeResult:
    """What one mode cost. Peaks are over the training phases of every step (not setup).

    Attributes:
        step_time_s: median step time, the first step left out when there are several (it
            allocates optimizer state and buffers that later steps reuse).
        host_pinned_bytes: bytes of the model's host buffers (parameters, gradients, boundary
            activations) when they are pinned; 0 when they are not (see ``notes``).
        host_model_bytes: bytes of the model's host copies of parameters and buffers, and of
            their copies in the compute dtype when there is one (offload).
        host_pool_peak_bytes: most bytes the pooled host buffers for gradients and boundary
            activations held at a phase end (offload).
        host_pinned_allocator_bytes: pinned bytes PyTorch's host allocator holds at the end of
            the mode, cached blocks and power-of-two rounding included (CUDA only).
        device_slot_bytes: bytes of the device slots that hold loaded slices (offload).
        error: why the mode stopped early (out of memory), else ``None``.
        notes: why a figure is ``None`` or 0.
    """

    mode: str
    label: str
    num_slices: int | None = None
    num_microbatches: int | None = None
    checkpoint_activation: bool | None = None
    compute_dtype: str | None = None
    error: str | None = None
    step_time_s: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    device_peak_allocated_bytes: int | None = None
    device_peak_reserved_bytes: int | None = None
    nvml_start_used_bytes: int | None = None
    nvml_peak_used_bytes: int | None = None
    host_rss_start_bytes: int | None = None
    host_rss_peak_bytes: int | None = None
    host_pinned_bytes: int | None = None
    host_pinned_allocator_bytes: int | None = None
    host_model_bytes: int | None = None
    host_pool_peak_bytes: int | None = None
    device_slot_bytes: int | None = None
    parameter_bytes: int | None = None
    phases: dict[str, PhaseFigures] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


@dataclass
class Profile:
    """The results of :func:`profile_modes`.

    Attributes:
        unavailable: figure group (``"device"``, ``"nvml"``, ``"host_pinned"``) to the reason it
            is missing; empty when everything was measured.
        figures: figure group to a line saying what was measured and how, or why not.
    """

    description: str
    device: str
    batch_size: int
    steps: int
    optimizer: str
    runs: list[ModeResult]
    samples: list[Sample]
    figures: dict[str, str]
    unavailable: dict[str, str]

    @property
    def on_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"

    def resident(self) -> ModeResult | None:
        return next((r for r in self.runs if r.mode == "resident" and r.error is None), None)

    def ratios_to_resident(self, run: ModeResult) -> dict[str, float | None]:
        """``run``'s step time and peaks divided by the resident mode's (``None`` where either is missing)."""
        base = self.resident()

        def ratio(name: str) -> float | None:
            mine, theirs = getattr(run, name), getattr(base, name, None)
            return mine / theirs if mine is not None and theirs else None

        return {"step_time": ratio("step_time_s"),
                "device_peak_allocated": ratio("device_peak_allocated_bytes"),
                "nvml_peak_used": ratio("nvml_peak_used_bytes"),
                "host_rss_peak": ratio("host_rss_peak_bytes")}

    def offloaded_peak(self) -> tuple[int | None, str, str]:
        """The largest peak over the offload modes: device allocated on CUDA, host RSS on the CPU.

        Returns:
            (bytes or ``None`` if an offload mode failed or none ran, what was measured, the mode's label).
        """
        what = "peak allocated device memory" if self.on_cuda else "peak host RSS (the device is the CPU)"
        name = "device_peak_allocated_bytes" if self.on_cuda else "host_rss_peak_bytes"
        runs = [r for r in self.runs if r.mode == "offload"]
        failed = [r for r in runs if r.error is not None or getattr(r, name) is None]
        if not runs or failed:
            return None, what, failed[0].label if failed else "no offload mode ran"
        worst = max(runs, key=lambda r: getattr(r, name))
        return getattr(worst, name), what, worst.label

    def to_json(self) -> dict[str, Any]:
        runs = []
        for run in self.runs:
            entry = asdict(run)
            entry["ratio_to_resident"] = self.ratios_to_resident(run)
            runs.append(entry)
        return {"description": self.description, "device": self.device, "batch_size": self.batch_size,
                "steps": self.steps, "optimizer": self.optimizer, "figures": self.figures,
                "unavailable": self.unavailable, "runs": runs}

    def write_csv(self, path: str) -> None:
        """The sampled timeline, one row per sample; empty cells where a figure is unavailable."""
        names = list(Sample.__dataclass_fields__)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(names)
            for sample in self.samples:
                writer.writerow(["" if v is None else (f"{v:.6f}" if isinstance(v, float) else v)
                                 for v in (getattr(sample, n) for n in names)])

    def table(self) -> str:
        """The summary per mode, then peaks per phase, then what could not be measured and why."""
        columns: list[tuple[str, Callable[[ModeResult], str]]] = [
            ("mode", lambda r: r.label),
            ("step", lambda r: _ms(r.step_time_s)),
            ("x res", lambda r: _times(self.ratios_to_resident(r)["step_time"])),
        ]
        if self.on_cuda:
            columns += [
                ("device peak alloc", lambda r: format_size(r.device_peak_allocated_bytes)),
                ("x res", lambda r: _times(self.ratios_to_resident(r)["device_peak_allocated"])),
                ("device peak reserved", lambda r: format_size(r.device_peak_reserved_bytes)),
            ]
            if "nvml" not in self.unavailable:
                columns.append(("NVML peak used", lambda r: format_size(r.nvml_peak_used_bytes)))
        columns += [
            ("host RSS peak", lambda r: format_size(r.host_rss_peak_bytes)),
            ("x res", lambda r: _times(self.ratios_to_resident(r)["host_rss_peak"])),
            ("pinned host", lambda r: format_size(r.host_pinned_bytes)),
        ]
        rows = [[c[1](r) if r.error is None or c[0] == "mode" else "-" for c in columns] for r in self.runs]
        for row, run in zip(rows, self.runs):
            if run.error is not None:
                row[1] = run.error
        lines = [f"{self.description}; batch {self.batch_size}, {self.steps} step(s) on {self.device}, "
                 f"{self.optimizer}; step: median step time after the first; x res: ratio to resident"]
        lines += _grid([c[0] for c in columns], rows)

        metric = "device_peak_allocated_bytes" if self.on_cuda else "host_rss_peak_bytes"
        lines.append("")
        what = "allocated device memory" if self.on_cuda else "host RSS"
        lines.append(f"peak {what} and median time per phase")
        phase_rows = []
        for run in self.runs:
            if run.error is None:
                phase_rows.append([run.label] + [
                    f"{format_size(getattr(run.phases[p], metric))} / {_ms(run.phases[p].time_s)}" for p in PHASES
                ])
        lines += _grid(["mode", *PHASES], phase_rows)
        lines.append("")
        lines += [f"{group}: {text}" for group, text in self.figures.items()]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Draw device and host memory over time, one line per mode, as a PNG at ``path``.

        Raises:
            PlotUnavailable: matplotlib is not installed.
        """
        Figure, FigureCanvasAgg = _matplotlib()
        device_panel = self.on_cuda
        figure = Figure(figsize=(13, 7.5 if device_panel else 4.5), layout="constrained")
        canvas = FigureCanvasAgg(figure)
        axes = figure.subplots(2 if device_panel else 1, 1, sharex=True, squeeze=False)[:, 0]
        colours = [f"C{k % 10}" for k in range(len(self.runs))]
        if device_panel:
            ax = axes[0]
            for run, colour in zip(self.runs, colours):
                samples = [s for s in self.samples if s.label == run.label]
                ax.plot([s.time_s for s in samples], [_gib(s.device_allocated_bytes) for s in samples],
                        color=colour, label=f"{run.label} (allocated)")
                if "nvml" not in self.unavailable:
                    ax.plot([s.time_s for s in samples], [_gib(s.nvml_used_bytes) for s in samples],
                            color=colour, linestyle="--", linewidth=1, label=f"{run.label} (NVML used)")
            ax.set_ylabel("device memory (GiB)")
            ax.set_title("device: allocator (solid)" + ("" if "nvml" in self.unavailable else ", NVML used (dashed)"))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        ax = axes[-1]
        for run, colour in zip(self.runs, colours):
            samples = [s for s in self.samples if s.label == run.label]
            ax.plot([s.time_s for s in samples], [_gib(s.host_rss_bytes) for s in samples], color=colour,
                    label=f"{run.label}" + ("" if run.error is None else f" ({run.error})"))
        ax.set_ylabel("host RSS (GiB)")
        ax.set_xlabel("seconds since the mode started (setup, then steps)")
        missing = "" if device_panel else f"; device figures unavailable ({self.unavailable.get('device', '')})"
        ax.set_title(f"host: process RSS{missing}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
        figure.suptitle(f"{self.description}\nbatch {self.batch_size}, {self.steps} step(s) on {self.device}",
                        fontsize=10)
        canvas.print_png(path)


class PlotUnavailable(RuntimeError):
    """matplotlib, needed only for plots, is not installed."""


def check_plotting() -> None:
    """Raise :class:`PlotUnavailable` now rather than after a long run."""
    _matplotlib()


def _matplotlib() -> tuple[Any, Any]:
    try:
        # The object-oriented API, not pyplot: no global backend is switched under a notebook.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable("plotting needs matplotlib, which is not installed: "
                              "pip install 'offload[plot]' (or pip install matplotlib)") from None
    return Figure, FigureCanvasAgg


class ModeFailed(RuntimeError):
    """A mode raised something other than running out of memory; the message names the mode."""


# -- running --------------------------------------------------------------------------------------------


def profile_modes(build: Callable[[], Preset], modes: Sequence[Mode], device: torch.device | str,
                  steps: int = 3, batch_size: int | None = None, optimizer: str = "adamw", lr: float = 1e-4,
                  sample_interval_s: float = 0.005, progress: Callable[[str], None] | None = None) -> Profile:
    """Train ``build()``'s model for ``steps`` steps in each mode and measure each.

    ``build`` is called once per mode, so every mode starts from a freshly built model (presets
    build the same weights every time) and nothing of one mode outlives it; it is called once
    more before that, for one unmeasured warm-up step of the first mode. A mode that runs out
    of device memory is reported as such and the next one runs.

    Args:
        build: returns a :class:`~offload.presets.Preset`, e.g. ``lambda: build_preset("mlp")``.
        modes: what to run, in order.
        device: compute device.
        steps: training steps per mode.
        batch_size: rows per step; the preset's own when ``None``.
        optimizer: ``"adamw"`` or ``"sgd"``. AdamW's state (two tensors per parameter) lives
            where the parameters live: on the device when resident, on the host when offloaded.
        progress: called with one line per mode and step.

    Raises:
        ValueError: no modes, a mode of unknown kind, ``steps < 1`` or an unknown optimizer.
        ModeFailed: a mode raised an error other than out-of-memory.
    """
    device = torch.device(device)
    if not modes:
        raise ValueError("no modes to profile")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(_OPTIMIZERS)}")
    for mode in modes:
        _empty_result(mode)  # an unknown kind fails here, before anything runs
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
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

    report = progress or (lambda line: None)
    description: str | None = None
    runs: list[ModeResult] = []
    try:
        with MemorySampler(device, nvml, sample_interval_s) as sampler:
            _warm_up(build, modes[0], device, batch_size, optimizer, sampler)
            for number, mode in enumerate(modes, 1):
                _reset_memory(device)
                where = f"[{number}/{len(modes)}] {mode.label}"
                result = _empty_result(mode)
                try:
                    built, rows = _run_mode(build, mode, result, device, steps, batch_size, optimizer, lr,
                                            sampler, lambda text, where=where: report(f"{where}: {text}"))
                    description, batch_size = description or built, batch_size or rows
                except torch.cuda.OutOfMemoryError as error:
                    result.error = "out of memory"
                    result.notes["error"] = _reason(error)
                    report(f"{where}: out of memory ({_reason(error)})")
                except Exception as error:
                    raise ModeFailed(f"mode '{mode.label}' failed: {_reason(error)}") from error
                _finish_notes(result, cuda, nvml is not None)
                runs.append(result)
                _reset_memory(device)
                sampler.sample()  # the end of the teardown: what the mode gave back
                sampler.pause()
    finally:
        if nvml is not None:
            nvml.close()
    return Profile(description or "model", str(device), batch_size or 0, steps, _OPTIMIZERS[optimizer][0],
                   runs, list(sampler.samples), figures, unavailable)


def _empty_result(mode: Mode) -> ModeResult:
    if mode.kind == "resident":
        return ModeResult(mode.kind, mode.label)
    if mode.kind == "offload":
        return ModeResult(mode.kind, mode.label, mode.num_slices, mode.num_microbatches, mode.checkpoint_activation,
                          None if mode.compute_dtype is None else str(mode.compute_dtype).removeprefix("torch."))
    raise ValueError(f"unknown mode kind {mode.kind!r}; use 'resident' or 'offload'")


def _run_mode(build: Callable[[], Preset], mode: Mode, result: ModeResult, device: torch.device, steps: int,
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
        model: torch.nn.Module = OffloadModel(preset.model, device=device, num_slices=mode.num_slices,
                                              num_microbatches=mode.num_microbatches,
                                              checkpoint_activation=mode.checkpoint_activation,
                                              compute_dtype=mode.compute_dtype)
    else:
        model = preset.model.to(device)
    optimizer = _OPTIMIZERS[optimizer_name][1](model.parameters(), lr)
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
    sampler.mark(steps, "teardown")
    return f"{preset.name}: {preset.description}", rows


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


def _progress_line(step: int, steps: int, step_time: float, figures: Iterable[PhaseFigures]) -> str:
    figures = list(figures)
    line = f"step {step}/{steps} {step_time * 1e3:.0f} ms"
    device = [f.device_peak_allocated_bytes for f in figures if f.device_peak_allocated_bytes is not None]
    if device:
        line += f", device peak allocated {format_size(max(device))}"
    return line + f", host RSS peak {format_size(max(f.host_rss_peak_bytes or 0 for f in figures))}"


def host_buffer_bytes(model: OffloadModel) -> dict[str, int | bool]:
    """Bytes OffloadModel holds outside the user's tensors, read from its engine.

    Returns:
        ``model`` (host copies of parameters and buffers), ``shadow`` (their copies in the
        compute dtype, with ``compute_dtype``), ``pool`` (pooled host buffers for gradients and
        boundary activations), ``slots`` (device slots), and ``pinned`` (whether the host buffers
        are pinned: only with a CUDA device).
    """
    engine = model._engine
    shadows = [getattr(s.storage, "shadow", None) for s in engine.slices]
    return {
        "model": sum(_nbytes(s.storage.flat) for s in engine.slices),
        "shadow": sum(_nbytes(shadow) for shadow in shadows if shadow is not None),
        "pool": engine.pool.nbytes,
        "slots": engine.slots.slot_nbytes * len(engine.slots._slots),
        "pinned": engine.pin,
    }


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _record_host_buffers(model: OffloadModel, result: ModeResult, figures: PhaseFigures) -> None:
    held = host_buffer_bytes(model)
    result.host_model_bytes = int(held["model"]) + int(held["shadow"])
    result.host_pool_peak_bytes = _max(result.host_pool_peak_bytes, int(held["pool"]))
    result.device_slot_bytes = int(held["slots"])
    pinned = result.host_model_bytes + int(held["pool"]) if held["pinned"] else 0
    figures.host_pinned_bytes = _max(figures.host_pinned_bytes, pinned)


def _finish_notes(result: ModeResult, cuda: bool, nvml: bool) -> None:
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


def _warm_up(build: Callable[[], Preset], mode: Mode, device: torch.device, batch_size: int | None,
             optimizer_name: str, sampler: MemorySampler) -> None:
    """One unmeasured step of ``mode`` before anything is measured.

    The first mode would otherwise pay one-time costs the others do not: the first optimizer
    imports a good part of PyTorch (about 80 MiB of RSS), the first kernels of each shape are
    selected, the heap grows to its working size and, on CUDA, the context and library handles
    are created.
    """
    try:
        _run_mode(build, mode, _empty_result(mode), device, 1, batch_size, optimizer_name, 1e-4, sampler,
                  lambda line: None)
    except Exception:
        pass  # the measured run of this mode fails the same way, and reports it
    sampler.discard()
    _reset_memory(device)


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
    _trim_host_heap()


def _trim_host_heap() -> None:
    # glibc keeps freed heap memory mapped, so RSS would not fall between modes without this.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


_OPTIMIZERS: dict[str, tuple[str, Callable[[Any, float], torch.optim.Optimizer]]] = {
    "adamw": ("AdamW", lambda params, lr: torch.optim.AdamW(params, lr=lr)),
    "sgd": ("SGD", lambda params, lr: torch.optim.SGD(params, lr=lr)),
}


def _typical(values: Sequence[float]) -> float | None:
    if not values:
        return None
    return statistics.median(values[1:] if len(values) > 1 else values)


def _max(current: int | None, new: int) -> int:
    return new if current is None else max(current, new)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _gib(nbytes: int | None) -> float:
    return float("nan") if nbytes is None else nbytes / 2**30


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(row[k])) for row in [header, *rows]) for k in range(len(header))]
    # The first column (mode labels) reads best left-aligned, numbers right-aligned.
    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if k == 0 else str(c).rjust(w) for k, (c, w) in enumerate(zip(cells, widths)))
    return [line(header), line(["-" * w for w in widths]), *[line(row) for row in rows]]
