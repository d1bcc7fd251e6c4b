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

This package measures and reports (table, JSON, CSV, plot); models and inputs come from
:mod:`offload.planning.presets`, and the command line is ``scripts/profile_memory.py``. Its files:

- ``modes``: what runs (:class:`Mode`, :func:`offload_modes`);
- ``runner``: every mode in turn, isolated from the others (:func:`profile_modes`, :class:`ModeFailed`,
  ``check_device``);
- ``measure``: one mode, phase by phase, into a result (:func:`host_buffer_bytes`);
- ``sampler``: the background thread that samples memory over time;
- ``nvml``: NVML's view of a GPU (:func:`open_nvml`);
- ``results``: what was found, as a table, JSON and CSV (:class:`Profile`);
- ``plot``: memory over time as a PNG (:class:`PlotUnavailable`, :func:`check_plotting`);
- ``outputs``: whether a result file can be written at a path, asked before a run (``check_output_path``);
- ``formatting``: sizes, times and ratios as text (:func:`parse_size`, :func:`format_size`).

The names below are the public surface; everything else is reached through its module.

Example::

    >>> from offload.planning.presets import build_preset
    >>> from offload.profiling import Mode, profile_modes
    >>> profile = profile_modes(lambda: build_preset("mlp"), [Mode.resident(), Mode.offload(4)], device="cuda")
    >>> print(profile.table())
"""

from .formatting import format_size, parse_size
from .measure import host_buffer_bytes
from .modes import Mode, offload_modes
from .nvml import open_nvml
from .plot import PlotUnavailable, check_plotting
from .results import Profile
from .runner import ModeFailed, profile_modes

__all__ = [
    "Mode",
    "ModeFailed",
    "PlotUnavailable",
    "Profile",
    "check_plotting",
    "format_size",
    "host_buffer_bytes",
    "offload_modes",
    "open_nvml",
    "parse_size",
    "profile_modes",
]
