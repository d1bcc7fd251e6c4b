"""Memory over time as a PNG: device memory (on CUDA) and host RSS, one line per mode.

Holds :func:`plot_profile` (what :meth:`Profile.plot <offload.profiling.results.Profile.plot>`
draws), :class:`PlotUnavailable` and :func:`check_plotting`. matplotlib is optional: it is imported
only when a plot is drawn or checked for, so nothing else in the package needs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..integrations import install_hint


class Plotted(Protocol):
    """What a plot reads of a :class:`~offload.profiling.results.Profile`. Named here rather than
    imported, so that this module stays below ``results.py``, whose ``Profile.plot`` calls it."""

    description: str
    device: str
    batch_size: int
    steps: int
    runs: Sequence[Any]
    samples: Sequence[Any]
    unavailable: Mapping[str, str]

    @property
    def on_cuda(self) -> bool: ...


class PlotUnavailable(RuntimeError):
    """matplotlib, needed only for plots, is not installed."""


def check_plotting() -> None:
    """Raise :class:`PlotUnavailable` now rather than after a long run."""
    _matplotlib()


# Ten colours, then the same ten dashed, dotted and dash-dotted: up to 40 modes, each its own
# line. Markers are left to the phases.
LINESTYLES = ("-", "--", ":", "-.")
# Where each training phase of each step starts, on every line.
PHASE_MARKERS = {"forward": ">", "backward": "<", "optimizer": "s"}


def line_style(k: int) -> dict[str, str]:
    """The colour and line style of the ``k``-th mode, distinct from every other mode's."""
    return {"color": f"C{k % 10}", "linestyle": LINESTYLES[(k // 10) % len(LINESTYLES)]}


def plot_profile(profile: Plotted, path: str) -> None:
    """Draw device and host memory over time, one line per mode, as a PNG at ``path``.

    Each line runs from the mode's setup to the end of its last step (its teardown, where the
    model is freed, is left out) and marks where each forward, backward and optimizer step
    begins. The memory axes start at 0.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    figure = draw_profile(profile, Figure)
    FigureCanvasAgg(figure).print_png(path)


def draw_profile(profile: Plotted, Figure: Any) -> Any:
    """The figure :func:`plot_profile` saves, built with matplotlib's ``Figure`` class."""
    device_panel = profile.on_cuda
    figure = Figure(figsize=(13, 7.5 if device_panel else 4.5), layout="constrained")
    axes = figure.subplots(2 if device_panel else 1, 1, sharex=True, squeeze=False)[:, 0]
    timelines = [[s for s in profile.samples if s.label == run.label and s.phase != "teardown"]
                 for run in profile.runs]
    if device_panel:
        ax = axes[0]
        for k, (run, samples) in enumerate(zip(profile.runs, timelines)):
            _line(ax, samples, "device_allocated_bytes", line_style(k), f"{run.label} (allocated)")
            if "nvml" not in profile.unavailable:
                ax.plot([s.time_s for s in samples], [_gib(s.nvml_used_bytes) for s in samples],
                        **line_style(k), linewidth=0.8, alpha=0.6, label=f"{run.label} (NVML used)")
        ax.set_ylabel("device memory (GiB)")
        ax.set_title("device: allocator" + ("" if "nvml" in profile.unavailable else ", NVML used (thin)"))
        _finish(ax)
    ax = axes[-1]
    for k, (run, samples) in enumerate(zip(profile.runs, timelines)):
        _line(ax, samples, "host_rss_bytes", line_style(k),
              f"{run.label}" + ("" if run.error is None else f" ({run.error})"))
    ax.set_ylabel("host RSS (GiB)")
    ax.set_xlabel("seconds since the mode started (setup, then steps)")
    missing = "" if device_panel else f"; device figures unavailable ({profile.unavailable.get('device', '')})"
    ax.set_title(f"host: process RSS{missing}")
    _finish(ax)
    figure.suptitle(f"{profile.description}\nbatch {profile.batch_size}, {profile.steps} step(s) on {profile.device}",
                    fontsize=10)
    return figure


def _line(ax: Any, samples: list[Any], figure: str, style: dict[str, str], label: str) -> None:
    ax.plot([s.time_s for s in samples], [_gib(getattr(s, figure)) for s in samples], **style, label=label)
    for phase, marker in PHASE_MARKERS.items():
        starts = [s for before, s in zip([None, *samples], samples)
                  if s.phase == phase and (before is None or (before.step, before.phase) != (s.step, phase))]
        ax.plot([s.time_s for s in starts], [_gib(getattr(s, figure)) for s in starts], marker=marker,
                markersize=4, linestyle="none", color=style["color"])


def _finish(ax: Any) -> None:
    for phase, marker in PHASE_MARKERS.items():
        ax.plot([], [], marker=marker, linestyle="none", color="black", label=f"{phase} starts")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))


def _matplotlib() -> tuple[Any, Any]:
    try:
        # The object-oriented API, not pyplot: no global backend is switched under a notebook.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable("plotting needs matplotlib, which is not installed: "
                              f"{install_hint('plot')} (or pip install matplotlib)") from None
    return Figure, FigureCanvasAgg


def _gib(nbytes: int | None) -> float:
    return float("nan") if nbytes is None else nbytes / 2**30
