"""Memory over time as a PNG: device memory (on CUDA) and host RSS, one line per mode.

Holds :func:`plot_profile` (what :meth:`Profile.plot <offload.profiling.results.Profile.plot>`
draws), :class:`PlotUnavailable` and :func:`check_plotting`. matplotlib is optional: it is imported
only when a plot is drawn or checked for, so nothing else in the package needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .results import Profile


class PlotUnavailable(RuntimeError):
    """matplotlib, needed only for plots, is not installed."""


def check_plotting() -> None:
    """Raise :class:`PlotUnavailable` now rather than after a long run."""
    _matplotlib()


def plot_profile(profile: Profile, path: str) -> None:
    """Draw device and host memory over time, one line per mode, as a PNG at ``path``.

    Raises:
        PlotUnavailable: matplotlib is not installed.
    """
    Figure, FigureCanvasAgg = _matplotlib()
    device_panel = profile.on_cuda
    figure = Figure(figsize=(13, 7.5 if device_panel else 4.5), layout="constrained")
    canvas = FigureCanvasAgg(figure)
    axes = figure.subplots(2 if device_panel else 1, 1, sharex=True, squeeze=False)[:, 0]
    colours = [f"C{k % 10}" for k in range(len(profile.runs))]
    if device_panel:
        ax = axes[0]
        for run, colour in zip(profile.runs, colours):
            samples = [s for s in profile.samples if s.label == run.label]
            ax.plot([s.time_s for s in samples], [_gib(s.device_allocated_bytes) for s in samples],
                    color=colour, label=f"{run.label} (allocated)")
            if "nvml" not in profile.unavailable:
                ax.plot([s.time_s for s in samples], [_gib(s.nvml_used_bytes) for s in samples],
                        color=colour, linestyle="--", linewidth=1, label=f"{run.label} (NVML used)")
        ax.set_ylabel("device memory (GiB)")
        ax.set_title("device: allocator (solid)" + ("" if "nvml" in profile.unavailable else ", NVML used (dashed)"))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax = axes[-1]
    for run, colour in zip(profile.runs, colours):
        samples = [s for s in profile.samples if s.label == run.label]
        ax.plot([s.time_s for s in samples], [_gib(s.host_rss_bytes) for s in samples], color=colour,
                label=f"{run.label}" + ("" if run.error is None else f" ({run.error})"))
    ax.set_ylabel("host RSS (GiB)")
    ax.set_xlabel("seconds since the mode started (setup, then steps)")
    missing = "" if device_panel else f"; device figures unavailable ({profile.unavailable.get('device', '')})"
    ax.set_title(f"host: process RSS{missing}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.suptitle(f"{profile.description}\nbatch {profile.batch_size}, {profile.steps} step(s) on {profile.device}",
                    fontsize=10)
    canvas.print_png(path)


def _matplotlib() -> tuple[Any, Any]:
    try:
        # The object-oriented API, not pyplot: no global backend is switched under a notebook.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotUnavailable("plotting needs matplotlib, which is not installed: "
                              "pip install 'offload[plot]' (or pip install matplotlib)") from None
    return Figure, FigureCanvasAgg


def _gib(nbytes: int | None) -> float:
    return float("nan") if nbytes is None else nbytes / 2**30
