"""What a profile found, and the ways it is written out: a table, JSON and the CSV timeline.

Holds :class:`PhaseFigures` (one phase), :class:`ModeResult` (one mode) and :class:`Profile` (every
mode, with the samples and a line per figure group saying how it was measured or why not). The
figures are filled in by :mod:`offload.profiling.measure`; the PNG is drawn by
:mod:`offload.profiling.plot`, which :meth:`Profile.plot` calls.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .formatting import format_ratio, format_size, format_time, grid
from .outputs import check_output_path
from .plot import plot_profile
from .sampler import Sample

PHASES = ("forward", "backward", "optimizer")
#: Printed under a CPU run's table: its step times are not what offloading costs on a GPU.
CPU_TIMING_CAVEAT = ("step times on the CPU: nothing overlaps (copies are synchronous and the device is host "
                     "memory), and steps vary from run to run; they do not predict a GPU's step times, and "
                     "ratios below 1.00x are noise")


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
        label: the mode's :attr:`~offload.profiling.Mode.label`, with the slices that ran.
        num_slices: the slices the model ran as (offload): the asked ``num_slices``, or the
            model's layer count when it has fewer layers (the label then says both).
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
    """The results of :func:`~offload.profiling.profile_modes`.

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
        """The sampled timeline, one row per sample; empty cells where a figure is unavailable.

        Raises:
            OSError: ``path`` cannot be written (a directory, a missing directory:
                :func:`~offload.profiling.outputs.check_output_path`).
        """
        check_output_path(path, "the CSV")
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
            ("step", lambda r: format_time(r.step_time_s)),
            ("x res", lambda r: format_ratio(self.ratios_to_resident(r)["step_time"])),
        ]
        if self.on_cuda:
            columns += [
                ("device peak alloc", lambda r: format_size(r.device_peak_allocated_bytes)),
                ("x res", lambda r: format_ratio(self.ratios_to_resident(r)["device_peak_allocated"])),
                ("device peak reserved", lambda r: format_size(r.device_peak_reserved_bytes)),
            ]
            if "nvml" not in self.unavailable:
                columns.append(("NVML peak used", lambda r: format_size(r.nvml_peak_used_bytes)))
        columns += [
            ("host RSS peak", lambda r: format_size(r.host_rss_peak_bytes)),
            ("x res", lambda r: format_ratio(self.ratios_to_resident(r)["host_rss_peak"])),
            ("pinned host", lambda r: format_size(r.host_pinned_bytes)),
        ]
        rows = [[c[1](r) if r.error is None or c[0] == "mode" else "-" for c in columns] for r in self.runs]
        for row, run in zip(rows, self.runs):
            if run.error is not None:
                row[1] = run.error
        # With one step there is none after the first to take the median of (ModeResult.step_time_s).
        timed = ("median step time after the first" if self.steps > 1 else
                 "time of the one step (the first: it also allocates the optimizer's state)")
        lines = [f"{self.description}; batch {self.batch_size}, {self.steps} step(s) on {self.device}, "
                 f"{self.optimizer}; step: {timed}; x res: ratio to resident"]
        lines += grid([c[0] for c in columns], rows)

        metric = "device_peak_allocated_bytes" if self.on_cuda else "host_rss_peak_bytes"
        lines.append("")
        what = "allocated device memory" if self.on_cuda else "host RSS"
        lines.append(f"peak {what} and {'median time' if self.steps > 1 else 'time'} per phase")
        phase_rows = []
        for run in self.runs:
            if run.error is None:
                phase_rows.append([run.label] + [
                    f"{format_size(getattr(run.phases[p], metric))} / {format_time(run.phases[p].time_s)}"
                    for p in PHASES
                ])
        lines += grid(["mode", *PHASES], phase_rows)
        lines.append("")
        lines += [f"{group}: {text}" for group, text in self.figures.items()]
        if not self.on_cuda:
            lines.append(CPU_TIMING_CAVEAT)
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Draw device and host memory over time, one line per mode, as a PNG at ``path``.

        Raises:
            PlotUnavailable: matplotlib is not installed.
            OSError: ``path`` cannot be written (a directory, a missing directory:
                :func:`~offload.profiling.outputs.check_output_path`).
        """
        check_output_path(path, "the plot")
        plot_profile(self, path)
