"""The configuration to train with: the fastest predicted one that fits the machine.

:func:`choose` tries every combination of ``num_slices``, microbatches, ``compute_dtype`` and
where the state lives (RAM; the optimizer's disk tier; the tier and the masters on disk; and the
shadows cast from them at each load, Note: [Shadows on disk]) and
when the host update runs (behind the next forward, or started in backward unless the gradients
are clipped: :data:`CHOSEN_SCHEDULES`), keeps as many of the first slices resident on the device
as fit beside the rest (on a CPU "device", none where they are predicted to save less than
:data:`RESIDENT_GAIN` of the step), unless a count is fixed (Note: [Resident slices] in
``offload/streams/resident_storage.py``), predicts each one's memory (:func:`~offload.estimate_memory`)
and step time (:func:`~offload.planning.timing.estimate_step_time`), keeps those that fit the
device, the host and the disk, and returns the fastest. Among configurations within 1 % of the
fastest it takes the simplest: fewer tiers on disk, then fewer microbatches, then the update
behind the next forward (it allows clipping), then the fastest.
When none fits it says what is missing, with and without the disk tier.

Memory fits a limit with a margin (:data:`DEVICE_MARGIN`, :data:`HOST_MARGIN`): the caching
allocator's fragments, the CUDA context, the loss's own tensors and the process's other memory
are not in the estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..arguments import resident_count
from .footprint import MemoryFootprint
from .planner import SliceLayout, footprints_by_resident, slice_layout
from .rates import MachineRates
from .shapes import ModelProfile
from .timing import SCHEDULES, StepConfig, StepTime, estimate_step_time

#: Share of the device's memory a plan may fill.
DEVICE_MARGIN = 0.9
#: Share of the host RAM a plan may fill.
HOST_MARGIN = 0.9
#: The slice counts tried (each capped at the model's stages): a count between two of them changes a
#: step's memory and time little, and every count adds a layout and a candidate per configuration.
SLICE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
#: The most microbatches tried below the batch itself (:func:`microbatch_counts`).
MICROBATCH_LIMIT = 64
#: (optimizer state, masters, shadows): where the state lives, simplest first.
PLACES = (("ram", "ram", "ram"), ("disk", "ram", "ram"), ("disk", "disk", "ram"), ("disk", "disk", "disk"))
#: The least share of the step that resident slices must save on a CPU "device" to be kept where
#: the configuration fits with none resident too. They save nothing there (no link, the same
#: update), and below it the model's approximations decide, not the machine: a resident slice's
#: slot copy makes one copy a tensor and skips the padding between them, which a streamed slice's
#: one copy of its flat layout carries (a tiny Llama's 64 bytes: 6 ns of a 9 ms step), and the
#: copies' bytes are counted where their calls are not. On a GPU they take their loads off the
#: link and their state out of host memory however little time that saves: kept unless slower.
RESIDENT_GAIN = 1e-3
#: The schedules tried, simplest first; ``"serial"`` is never faster, so only a fixed choice gets it.
#: ``"in-backward"`` is left out when the gradients are clipped (``update_in_backward`` refuses it).
CHOSEN_SCHEDULES = ("overlapped", "in-backward")


@dataclass(frozen=True)
class Limits:
    """The machine: bytes of device memory, host RAM and free disk, and the most host memory the
    platform lets the driver pin (WSL2 and some containers cap it below the RAM); ``None``: no
    limit."""

    device_memory: int | None
    host_memory: int | None
    disk: int | None = None
    disk_dir: str | None = None
    pinned_memory: int | None = None


@dataclass(frozen=True)
class Candidate:
    """One configuration, its predicted memory and time, and what of the limits it exceeds."""

    config: StepConfig
    memory: MemoryFootprint
    time: StepTime
    #: Host bytes it needs (on a CPU "device", the device's bytes too: they are host memory).
    host_need: int = 0
    over: dict[str, int] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.over


@dataclass(frozen=True)
class Plan:
    """:func:`choose`'s answer: the chosen candidate (``None`` when nothing fits), every candidate
    tried, and what is missing when nothing fits."""

    chosen: Candidate | None
    candidates: list[Candidate]
    missing: str = ""


def choose(layers: nn.Module | Sequence[int], profile_for: Callable[[torch.dtype | None], ModelProfile | None],
           rates: MachineRates, limits: Limits, *, device: str = "cuda", optimizer: str | None = "adamw",
           param_dtype: torch.dtype = torch.float32, batch_size: int = 1, fixed: dict[str, Any] | None = None,
           clips_gradients: bool = False) -> Plan:
    """The fastest predicted configuration that fits ``limits``.

    Args:
        layers: as :func:`~offload.estimate_memory` takes them.
        profile_for: the model's shapes for the batch under a compute dtype
            (:func:`~offload.planning.shapes.profile_layers`), called once per dtype tried.
        rates: the machine's (:mod:`offload.planning.rates`).
        limits: its memory and disk.
        batch_size: rows per step (the microbatch counts tried divide it: :func:`microbatch_counts`).
        fixed: :class:`~offload.planning.timing.StepConfig` fields to keep as given
            (``{"compute_dtype": None}``, ``{"num_slices": 8}``, ``{"schedule": "serial"}``,
            ``{"resident_slices": 0}``). Without ``resident_slices`` each configuration keeps the
            most of its first slices resident that fit the limits (on a GPU its step is faster
            with each); on a CPU "device", none where they are predicted to save less than
            :data:`RESIDENT_GAIN` of the step.
        clips_gradients: the training changes the gradients between backward and ``step()``
            (``clip_grad_norm_``, a ``GradScaler``): the update cannot start in backward, so
            ``"in-backward"`` is not tried.

    Raises:
        ValueError: an unknown field in ``fixed``, an unknown schedule, ``"in-backward"`` fixed
            with ``clips_gradients``, or ``resident_slices`` fixed below 0 or above a fixed ``num_slices``.
    """
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - set(StepConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"cannot fix {unknown}; StepConfig has {sorted(StepConfig.__dataclass_fields__)}")
    if "schedule" in fixed and fixed["schedule"] not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {fixed['schedule']!r}")
    if clips_gradients and fixed.get("schedule") == "in-backward":
        raise ValueError("the 'in-backward' schedule cannot clip the gradients: each slice's update starts in "
                         "backward, before their total norm is known. Fix another schedule, or do not clip")
    if "resident_slices" in fixed:
        resident_count(fixed["resident_slices"], fixed.get("num_slices", fixed["resident_slices"]))
    schedules = [s for s in CHOSEN_SCHEDULES if not (clips_gradients and s == "in-backward")]
    profiles: dict[Any, ModelProfile | None] = {}
    layouts: dict[tuple[int, Any], SliceLayout] = {}
    # The schedule changes the time, not the memory: one list per rest of the config, by resident count.
    memories: dict[StepConfig, list[MemoryFootprint]] = {}
    candidates = []
    for config in _configs(layers, batch_size, limits, fixed, schedules):
        # Clipped, the plan computes the norms in backward and scales in the update where the
        # gradients are in RAM.
        in_ram = clips_gradients and config.masters != "disk"
        config = replace(config, clips_gradients=clips_gradients, norms_in_backward=in_ram, scale_in_update=in_ram)
        if config.compute_dtype not in profiles:
            profiles[config.compute_dtype] = profile_for(config.compute_dtype)
        key = (config.num_slices, config.compute_dtype)
        if key not in layouts:
            layouts[key] = slice_layout(layers, num_slices=config.num_slices, param_dtype=param_dtype,
                                        compute_dtype=config.compute_dtype, optimizer=optimizer)
        candidates.append(_candidate(layouts[key], profiles[config.compute_dtype], config, rates, limits,
                                     memories, fixed, device=device, optimizer=optimizer, param_dtype=param_dtype))
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return Plan(chosen=None, candidates=candidates, missing=missing(candidates, limits))
    best = min(c.time.step for c in fitting)
    near = [c for c in fitting if c.time.step <= 1.01 * best]
    chosen = min(near, key=lambda c: (PLACES.index((c.config.optimizer_state, c.config.masters, c.config.shadows)),
                                      c.config.num_microbatches, SCHEDULES.index(c.config.schedule), c.time.step))
    return Plan(chosen=chosen, candidates=candidates)


def _configs(layers: nn.Module | Sequence[int], batch_size: int, limits: Limits, fixed: dict[str, Any],
             schedules: Sequence[str]) -> list[StepConfig]:
    count = len(list(layers.children())) if isinstance(layers, nn.Module) else len(layers)
    slices = sorted({min(n, count) for n in SLICE_COUNTS})
    microbatches = microbatch_counts(batch_size)
    dtypes: list[torch.dtype | None] = [None, torch.bfloat16]
    places = PLACES if limits.disk_dir is not None else PLACES[:1]
    configs = []
    resident = fixed.get("resident_slices", 0)
    for n in ([fixed["num_slices"]] if "num_slices" in fixed else [n for n in slices if n >= resident]):
        for m in ([fixed["num_microbatches"]] if "num_microbatches" in fixed else microbatches):
            for dtype in ([fixed["compute_dtype"]] if "compute_dtype" in fixed else dtypes):
                for state, masters, shadows in places:
                    if masters == "disk" and dtype is None:
                        continue  # masters on disk need a compute dtype: loads read the shadow
                    for schedule in ([fixed["schedule"]] if "schedule" in fixed else schedules):
                        config = StepConfig(num_slices=n, num_microbatches=m, compute_dtype=dtype,
                                            optimizer_state=state, masters=masters, shadows=shadows,
                                            schedule=schedule)
                        configs.append(replace(config, **{k: v for k, v in fixed.items()
                                                          if k in ("optimizer_state", "masters", "shadows",
                                                                   "resident_slices")}))
    return list(dict.fromkeys(configs))


def microbatch_counts(batch_size: int) -> list[int]:
    """The microbatch counts :func:`choose` tries: every count up to :data:`MICROBATCH_LIMIT` that
    divides the batch, and the batch itself (a row a microbatch: the least activation memory).
    An odd batch needs its odd divisors; a count past the limit only saves another share of the
    activations, and each count adds a candidate per configuration."""
    return sorted({m for m in range(1, min(batch_size, MICROBATCH_LIMIT) + 1) if batch_size % m == 0} | {batch_size})


def _candidate(layout: SliceLayout, profile: ModelProfile | None,
               config: StepConfig, rates: MachineRates, limits: Limits,
               memories: dict[StepConfig, list[MemoryFootprint]], fixed: dict[str, Any], **common: Any) -> Candidate:
    device, optimizer, param_dtype = common["device"], common["optimizer"], common["param_dtype"]
    key = replace(config, schedule=SCHEDULES[0], resident_slices=0)
    if key not in memories:
        memories[key] = footprints_by_resident(layout, profile, compute_dtype=config.compute_dtype,
                                               optimizer_state=config.optimizer_state, masters=config.masters,
                                               shadows=config.shadows,
                                               num_microbatches=config.num_microbatches, device=device)
    by_resident = memories[key]
    if "resident_slices" not in fixed:
        # The most resident slices that fit: each one moves its bytes from the host to the device
        # and takes its loads, offloads and host update off the step.
        fitting = [k for k, memory in enumerate(by_resident) if not _over(memory, limits, device)]
        resident = max(fitting) if fitting else _least_short(by_resident, limits, device)
        config = replace(config, resident_slices=resident)
    time = estimate_step_time(layout, profile, config, rates, device=device, optimizer=optimizer,
                              param_dtype=param_dtype)
    if ("resident_slices" not in fixed and config.resident_slices
            and not _over(by_resident[0], limits, device)):
        # On a CPU "device" they save no link, and their update leaves the worker for step()
        # (offload/planning/timing.py): none resident where that is predicted no faster, to
        # within RESIDENT_GAIN (on a GPU, within rounding: the two sums add the same times in
        # another order, a last bit apart).
        streamed = estimate_step_time(layout, profile, replace(config, resident_slices=0), rates, device=device,
                                      optimizer=optimizer, param_dtype=param_dtype)
        gain = RESIDENT_GAIN if torch.device(device).type == "cpu" else 1e-9
        if streamed.step <= time.step * (1 + gain):
            config, time = replace(config, resident_slices=0), streamed
    memory = by_resident[config.resident_slices]
    return Candidate(config=config, memory=memory, time=time, host_need=_host_need(memory, device),
                     over=_over(memory, limits, device))


def _least_short(by_resident: list[MemoryFootprint], limits: Limits, device: str) -> int:
    """The resident count to plan when none fits, so that what is missing is the least (choose's
    "nothing fits"): of the counts that fit the device, one that fits the disk before one that
    does not, then one that fits the host; the least host memory where none does, else the least
    disk (resident slices take their state off the disk, and may need more host memory for it).
    Ties: the most resident."""
    def short(k: int) -> tuple[Any, ...]:
        over, memory = _over(by_resident[k], limits, device), by_resident[k]
        host = _host_need(memory, device) if "host" in over else 0
        return "disk" in over, "host" in over, host, memory.disk, _host_need(memory, device), -k

    device_ok = [k for k, memory in enumerate(by_resident)
                 if not set(_over(memory, limits, device)) - {"host", "disk"}] or [0]
    return min(device_ok, key=short)


def _host_need(memory: MemoryFootprint, device: str) -> int:
    # On a CPU "device" the device's bytes are host memory too.
    return memory.host_total + (memory.device_total if torch.device(device).type == "cpu" else 0)


def _over(memory: MemoryFootprint, limits: Limits, device: str) -> dict[str, int]:
    """What of ``limits`` (with their margins) ``memory`` exceeds, by name."""
    over = {}
    on_device = torch.device(device).type != "cpu"
    host_need = _host_need(memory, device)
    if on_device and limits.device_memory is not None and memory.device_total > DEVICE_MARGIN * limits.device_memory:
        over["device"] = memory.device_total
    if limits.host_memory is not None and host_need > HOST_MARGIN * limits.host_memory:
        over["host"] = host_need
    if memory.disk and limits.disk is not None and memory.disk > limits.disk:
        over["disk"] = memory.disk
    if limits.pinned_memory is not None and memory.pinned_bytes > limits.pinned_memory:
        over["pinned"] = memory.pinned_bytes
    return over


@dataclass(frozen=True)
class Needs:
    """The least of each limit under which some candidate fits, margins included (bytes): what
    ``--device-memory``, ``--host-memory`` and ``--disk`` would have to be.

    ``device_memory`` is the least over every candidate; the host figures are over those that fit
    the device (``None`` when none does), with the state in RAM and with the optimizer's disk
    tier (``None`` when no candidate has it: no ``disk_dir``). ``tiered_disk`` is the least disk
    of the tiered candidates that fit the host as it is or with ``tiered_host_memory``: a
    candidate with more slices resident may need less disk than the one that needs the least
    host memory."""

    device_memory: int
    host_memory: int | None = None
    tiered_host_memory: int | None = None
    tiered_disk: int | None = None
    #: The candidate that needs the least device memory, for its configuration.
    least_device: Candidate | None = None


def least_needs(candidates: Sequence[Candidate], limits: Limits) -> Needs:
    """What each limit must be for one of ``candidates`` to fit (with :data:`DEVICE_MARGIN` and
    :data:`HOST_MARGIN`): the host's among those that fit ``limits``'s device."""
    least = min(candidates, key=lambda c: c.memory.device_total)
    needs = Needs(device_memory=_ceil(least.memory.device_total / DEVICE_MARGIN), least_device=least)
    device_ok = [c for c in candidates if "device" not in c.over]
    in_ram = [c for c in device_ok if c.config.optimizer_state != "disk"]
    tiered = [c for c in device_ok if c.config.optimizer_state == "disk"]
    if in_ram:
        needs = replace(needs, host_memory=_ceil(min(c.host_need for c in in_ram) / HOST_MARGIN))
    if tiered:
        best = min(tiered, key=lambda c: c.host_need)
        # The disk: the least of those the host has room for (or that need no more than the least
        # host memory), which typed back as --disk fits; the least-host one's may be more.
        room = max(best.host_need, HOST_MARGIN * limits.host_memory if limits.host_memory is not None else math.inf)
        disk = min(c.memory.disk for c in tiered if c.host_need <= room)
        needs = replace(needs, tiered_host_memory=_ceil(best.host_need / HOST_MARGIN), tiered_disk=disk)
    return needs


def missing(candidates: Sequence[Candidate], limits: Limits) -> str:
    """What the machine lacks, in words: the least host memory (and disk) a configuration that
    fits the device needs, in RAM and with the disk tier; or the least device memory. The
    figures include the margins (:data:`DEVICE_MARGIN`, :data:`HOST_MARGIN`)."""
    needs = least_needs(candidates, limits)
    unpinned = [c for c in candidates if set(c.over) == {"pinned"}]
    if unpinned:  # everything else fits: the pinned memory alone is short
        least = min(unpinned, key=lambda c: c.memory.pinned_bytes)
        return (f"needs {gib(least.memory.pinned_bytes)} of pinned host memory at the least; the platform pins "
                f"{gib(limits.pinned_memory or 0, up=False)} (--pinned-memory)")
    if needs.host_memory is None and needs.tiered_host_memory is None:
        config = needs.least_device.config
        return (f"needs {gib(needs.device_memory)} of device memory at the least "
                f"({config.num_slices} slices, {config.num_microbatches} microbatches); "
                f"has {gib(limits.device_memory or 0, up=False)}")
    parts = []
    if needs.host_memory is not None:
        parts.append(f"needs {gib(needs.host_memory)} of host memory")
    if needs.tiered_host_memory is not None:
        where = f" on {limits.disk_dir}" if limits.disk_dir else ""
        parts.append(f"with the disk tier{where} it needs {gib(needs.tiered_host_memory)} of host memory and "
                     f"{gib(needs.tiered_disk)} of disk")
    # What the machine has, named where a disk figure precedes it (a bare figure would read as the disk's).
    has = []
    if limits.host_memory is not None:
        has.append(gib(limits.host_memory, up=False) + (" of host memory" if needs.tiered_host_memory is not None
                                                          else ""))
    if needs.tiered_host_memory is not None and limits.disk is not None:
        has.append(f"{gib(limits.disk, up=False)} of disk")
    return "; ".join(parts) + (f" (has {' and '.join(has)})" if has else "")


def _ceil(nbytes: float) -> int:
    return int(-(-nbytes // 1))


def gib(nbytes: float, up: bool = True) -> str:
    """``nbytes`` in GiB as the planner's messages print it: to 0.1 GiB, 0.01 below 10 GiB;
    rounded ``up`` for a need (the figure printed is enough), to the nearest for what a machine has."""
    step = 10 if nbytes >= 10 * 2**30 else 100
    value = (math.ceil(nbytes * step / 2**30 - 1e-9) if up else round(nbytes * step / 2**30)) / step
    return f"{value:.1f} GiB" if step == 10 else f"{value:.2f} GiB"
