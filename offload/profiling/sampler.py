"""Memory over time: a background thread samples host RSS, NVML and the allocator, labelled with what runs.

Holds :class:`Sample` (one moment) and :class:`MemorySampler` (the thread, and the marks the main
thread sets at phase boundaries). Allocator *peaks* are not sampled here (they are exact, read at
phase ends by :mod:`offload.profiling.measure`), and nothing here summarises samples into results.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import psutil
import torch

from .nvml import NvmlMemory


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
        self._mode_start = 0  # the index in samples of the running mode's first sample
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
            self._mode_start = len(self.samples)
            return self._take()

    def relabel(self, label: str) -> None:
        """File the running mode's samples, those taken and those to come, under ``label``: a
        mode's label says the slices it ran as, known only once its model is built, and the CSV
        and the plot find a mode's samples by its label."""
        with self._lock:
            self._label = label
            self.samples[self._mode_start:] = [replace(s, label=label) for s in self.samples[self._mode_start:]]

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
            self._label, self._mode_start = "", 0

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
