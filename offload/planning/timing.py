"""How long one training step takes: a cost model of the walk, from a model's shapes and a
machine's rates.

One step is a forward (each slice loaded, run on every microbatch, its boundary activations
offloaded), a backward (each slice loaded again but the two still in the slots, recomputed and
differentiated microbatch by microbatch, its gradients offloaded) and the host update (every
trainable parameter read and written once by the optimizer, the bfloat16 shadow written beside
it, the disk tier's files read and written). The terms:

- device compute: the forward's operations, then the recompute's and the backward's, over the
  device's rate for the compute dtype (``MachineRates.device_flops``), plus a fixed host cost
  per slice run;
- the link: bytes loaded and offloaded over each direction's bandwidth. On a GPU copies run on
  their own streams beside compute, so a phase takes the longest of its compute, its loads and
  its offloads, plus the first load (forward) or the last offload (backward) that nothing hides;
  on a CPU "device" copies are synchronous and add up;
- the host update: the host memory bytes it touches, as ``host_bytes.py`` counts them (the
  optimizer's pass; the shadow's pass, which re-reads every master whose load casts it: not a
  parameter already in the compute dtype, nor a batch or instance norm's, which have no shadow, as
  :class:`~offload.planning.planner.SliceLayout` counts them), the optimizer's pass over
  the fused update's measured rate (``MachineRates.host_update``, the same count's bytes per
  second) and the shadow's over the host's memory bandwidth (``MachineRates.host_memory``); with
  the disk tier, the longest of it and the files' reads and writes (the tier reads, updates and
  writes different slices at once);
- the schedule. ``"overlapped"`` (``OffloadOptimizer``'s default): the update runs on the host
  while the next forward runs, slice by slice; slice *k*'s forward waits for slice *k*'s update
  (:func:`exposed_overlapped`, a per-slice simulation: for equal slices the forward takes the
  longer of itself plus one slice's update and the update plus one slice's forward).
  ``"in-backward"`` (``OffloadOptimizer(..., update_in_backward=True)``): each slice's update
  starts when its gradients land in backward, and the next forward waits for all of them
  (:func:`exposed_in_backward`, a per-slice simulation). ``"serial"``: the update after the
  backward, all of it exposed (a plain optimizer, or ``synchronize()`` each step).
- resident slices (``OffloadModel(..., resident_slices=k)``, Note: [Resident slices] in
  ``offload/streams/resident_storage.py``): their loads and gradients do not cross the link and
  they have no host update. Their update runs on the device in ``step()``, before the next
  forward, in :data:`~offload.planning.rates.UPDATE_BYTES_PER_PARAMETER` bytes per parameter
  over the device's memory bandwidth (``MachineRates.device_memory_bandwidth``); it adds to the
  step. Their slot copies (a device-to-device copy, a cast under a compute dtype) run on the
  compute stream: their bytes, read and written, over that bandwidth add to the device's time.
  The next forward runs them before it waits for any host update. On a CPU "device" there is no
  link to save: a resident slice's copies cost what a streamed slice's loads and offloads cost
  (both are copies in RAM), and its update, the host's fused update at ``host_update``, runs in
  ``step()`` instead of beside the next forward; so in float32 resident slices never make a CPU
  step faster. (A slot copy, a copy a tensor, skips the few bytes of padding between them that a
  streamed load's one copy of the flat layout carries: ``choose`` takes that gain for none,
  :data:`~offload.planning.choose.RESIDENT_GAIN`.)

It predicts; it does not measure (``offload/cli/calibrate.py`` measures the rates). Checked in
``tests/test_planning.py`` on the CPU against a step whose device work is a known sleep, and
against the H100 results in ``benchmarks/results/planner_vs_h100_2026-11-26.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from . import host_bytes
from .host_bytes import host_bytes_per_step
from ..arguments import resident_count
from .planner import SliceLayout
from .rates import DEVICE_MEMORY_BANDWIDTH_DEFAULT, MachineRates
from .shapes import ModelProfile

#: How the host update meets the device's work: behind the next forward (the default), started in
#: backward (``update_in_backward=True``), or after the step.
SCHEDULES = ("overlapped", "in-backward", "serial")


@dataclass(frozen=True)
class StepConfig:
    """The choices a step's time and memory depend on, as ``OffloadModel``/``OffloadOptimizer`` take them.

    Attributes:
        num_slices, num_microbatches, compute_dtype: as :class:`~offload.OffloadModel` takes them.
        optimizer_state: ``"ram"`` or ``"disk"`` (the optimizer's :class:`~offload.DiskTier`).
        masters: ``"ram"`` or ``"disk"`` (``OffloadModel(..., masters=DiskTier(...))``).
        shadows: ``"ram"`` or ``"disk"`` (``OffloadModel(..., shadows="disk")``: each load reads
            its masters from the disk and casts them, Note: [Shadows on disk]).
        schedule: one of :data:`SCHEDULES`.
        resident_slices: as :class:`~offload.OffloadModel` takes it.
        clips_gradients: the training clips the gradients' total norm between backward and
            ``step()`` with :func:`offload.clip_grad_norm_` (Hugging Face's ``Trainer`` clips at
            its default ``max_grad_norm=1.0``, through it after ``parallel_clipping(trainer)``):
            the host reads every streamed slice's float32 gradients for the norm, on several
            threads, each tensor on one, then scales them (read and written), while the device
            waits. Not with the ``"in-backward"`` schedule.
        norms_in_backward: with ``clips_gradients``, the norms are computed in backward as each
            slice's gradients land (``OffloadOptimizer(..., norms_in_backward=True)``, Note: [Norms
            from backward]): the step waits for what backward does not cover. Not with masters on disk
            (the gradients' home is their file).
        scale_in_update: with ``clips_gradients``, each slice's update does the clip's scaling of
            its host gradients (``OffloadOptimizer(..., scale_in_update=True)``, Note: [Scaling in
            the update]; where the one-pass kernel runs, only their write-back): it adds to the
            update the next forward overlaps, not to the step. Not with masters on disk.
    """

    num_slices: int = 8
    num_microbatches: int = 1
    compute_dtype: torch.dtype | None = None
    optimizer_state: str = "ram"
    masters: str = "ram"
    shadows: str = "ram"
    schedule: str = "overlapped"
    resident_slices: int = 0
    clips_gradients: bool = False
    norms_in_backward: bool = False
    scale_in_update: bool = False


@dataclass(frozen=True)
class StepTime:
    """One step's predicted time and what it is made of, in seconds.

    Attributes:
        compute: the device's forward and backward operations without the recompute (what a
            resident model would compute): the numerator of :attr:`efficiency`.
        forward_compute, backward_compute: device time per phase (the backward's includes the
            recompute), with the slice runs' fixed cost.
        load, offload: time on the link each way, whole step.
        update: the host update (and the disk tier's traffic, where it is longer).
        disk_read, disk_write: the disk tier's files.
        forward, backward: each phase's length, overlap counted.
        exposed_update: what the step waits for the host update.
        step: the step.
        device_update: the resident slices' update on the device (all of it in the step).
        clip: the host's clipping of the streamed slices' gradients (all of it in the step;
            :attr:`StepConfig.clips_gradients`).
        staging: the loads' reads of their masters from the disk and their casts, forward and
            backward together (``shadows="disk"``; in the phases' lengths, beside their compute).
    """

    compute: float
    forward_compute: float
    backward_compute: float
    load: float
    offload: float
    update: float
    disk_read: float
    disk_write: float
    forward: float
    backward: float
    exposed_update: float
    step: float
    device_update: float = 0.0
    clip: float = 0.0
    staging: float = 0.0

    @property
    def efficiency(self) -> float:
        """``compute / step``: the share of the step the device does useful work."""
        return self.compute / self.step if self.step else 0.0

    def to_json(self) -> dict[str, float]:
        return asdict(self) | {"efficiency": self.efficiency}


@dataclass(frozen=True)
class _Traffic:
    """Bytes of one step, per phase and direction, the host update's (``update``: the optimizer's
    pass; ``shadow``: the shadow's pass, as ``host_bytes.py`` counts them), and the resident slices'
    (their slot copies and their update, on the device)."""

    forward_loads: int
    forward_offloads: int
    backward_loads: int
    backward_offloads: int
    first_load: int
    last_offload: int
    update: int
    shadow: int
    disk_read: int
    disk_write: int
    device_copies: int = 0
    device_update: int = 0
    #: masters the loads read from the disk, per phase (``shadows="disk"``, Note: [Shadows on disk])
    forward_staged: int = 0
    backward_staged: int = 0


#: Whether gradients the host copies into their files (masters on disk) leave the device in the
#: compute dtype (Note: [Gradients in the compute dtype] in ``offload/streams/gradients.py``).
#: Runs measured before they did are predicted under :func:`landed_gradients` ``(in_compute_dtype=False)``.
LANDED_IN_COMPUTE_DTYPE = True


@contextlib.contextmanager
def landed_gradients(in_compute_dtype: bool) -> Iterator[None]:
    """Count (and so plan) the gradients the host copies into their files as leaving in the
    compute dtype or in their parameters' dtype, whatever this library does: to predict a run
    measured before they left in the compute dtype."""
    global LANDED_IN_COMPUTE_DTYPE
    saved, LANDED_IN_COMPUTE_DTYPE = LANDED_IN_COMPUTE_DTYPE, in_compute_dtype
    try:
        yield
    finally:
        LANDED_IN_COMPUTE_DTYPE = saved


def traffic(layout: SliceLayout, profile: ModelProfile | None, config: StepConfig,
            optimizer: str | None = "adamw") -> _Traffic:
    """Bytes a step moves, as ``offload/streams/copies.py`` counts them (``loaded_bytes``,
    ``offloaded_bytes``): the backward reloads every slice but the two left in the slots, and the
    checkpointed boundary activations travel out in the forward and back in the backward. The
    first ``config.resident_slices`` slices load by a device copy and keep their gradients on the
    device (``device_copies``: those copies' bytes read and written) and are updated there
    (``device_update``)."""
    n, k = layout.num_slices, config.resident_slices
    boundaries = profile.checkpointed_bytes(layout.ranges, config.num_microbatches) if profile is not None else 0
    streamed_grads = layout.gradient_bytes[k:]
    # With one microbatch, gradients the host copies into their files (masters on disk) leave in
    # the compute dtype (Note: [Gradients in the compute dtype]); the others, and sums over
    # microbatches, in float32.
    leaving = (layout.computed_gradient_bytes if LANDED_IN_COMPUTE_DTYPE and config.num_microbatches == 1
               and config.masters == "disk" and layout.computed_gradient_bytes else layout.gradient_bytes)
    state_bytes = sum(layout.state_bytes[k:]) if config.optimizer_state == "disk" else 0
    casts, cast_masters, cast_gradients = _of_casting_slices(layout, k)
    master_bytes, gradient_file_bytes = (cast_masters, cast_gradients) if config.masters == "disk" else (0, 0)
    # The host bytes per float32 parameter (host_bytes.py); other dtypes scale with their size. A
    # resident slice's update on the device writes no shadow.
    staged = config.shadows == "disk"
    # With the shadows on disk no update writes one: the loads cast the masters (Note: [Shadows on disk]).
    host = host_bytes_per_step(1, compute_dtype=config.compute_dtype, optimizer=optimizer,
                               shadow_in_update=False if staged else None)
    if staged:
        host = replace(host, shadow=0)
    per_byte = host_bytes_per_step(1, optimizer=optimizer).update / 4
    # Only the parameters a load casts have a shadow: not those already in the compute dtype, nor
    # a batch or instance norm's (SliceLayout.cast_gradient_bytes, as the memory estimate counts them).
    cast_grads = sum((layout.cast_gradient_bytes or layout.gradient_bytes)[k:])
    cast_trained = sum((layout.cast_trainable_bytes or layout.trainable_bytes)[k:])
    reloaded = range(max(n - 2, 0))  # the backward's loads: all but the two slices left in the slots
    # A resident slot copy reads the parameters (their own dtype) and writes the slot; a resident
    # slice's gradients are copied once from the summing buffers into memory of their own.
    resident_loads = sum(layout.tensor_bytes[j] + layout.device_bytes[j] for j in range(k))
    resident_reloads = sum(layout.tensor_bytes[j] + layout.device_bytes[j] for j in reloaded if j < k)
    return _Traffic(
        forward_loads=sum(layout.device_bytes[k:]),
        forward_offloads=boundaries,
        backward_loads=sum(layout.device_bytes[j] for j in reloaded if j >= k) + boundaries,
        # A slice that borrows a trainable weight from a streamed slice sends that gradient too.
        backward_offloads=sum(leaving[k:]) + sum(b for tied in layout.borrowed_gradients[k:] for holder, b in tied
                                                 if holder >= k),
        first_load=layout.device_bytes[0] if k == 0 else 0,
        # Slice 0's gradients leave last; a resident one's do not leave, and the streamed slices'
        # cross while the resident ones' backward runs.
        last_offload=leaving[0] if k == 0 else 0,
        update=round(host.update / 4 * cast_grads + per_byte * (sum(streamed_grads) - cast_grads)),
        # Each cast parameter's shadow is written from its master: a pass of its own, or the update's.
        shadow=round(host.shadow / 4 * cast_trained),
        disk_read=state_bytes + master_bytes + gradient_file_bytes,
        disk_write=state_bytes + master_bytes + gradient_file_bytes,
        device_copies=resident_loads + resident_reloads + 2 * sum(layout.gradient_bytes[:k]),
        device_update=round(per_byte * sum(layout.gradient_bytes[:k])),
        forward_staged=cast_masters if staged else 0,
        backward_staged=sum(layout.host_bytes[j] for j in reloaded if j >= k and casts[j - k]) if staged else 0,
    )


def _of_casting_slices(layout: SliceLayout, resident: int) -> tuple[list[bool], int, int]:
    """Of the streamed slices (after the first ``resident``): whether each one's load casts
    (``SliceLayout.casts``), and the bytes of the masters and of the gradients of those that do.
    Only such a slice has a shadow (or stages one), and, with the masters on disk, files for its
    masters and for its gradients, written as they land and read by the update (Note: [Gradients
    on disk] in ``offload/streams/gradient_files.py``); the others keep both in RAM."""
    casts = (layout.casts or [True] * layout.num_slices)[resident:]
    return (casts, sum(h for h, c in zip(layout.host_bytes[resident:], casts) if c),
            sum(g for g, c in zip(layout.gradient_bytes[resident:], casts) if c))


def estimate_step_time(layout: SliceLayout, profile: ModelProfile | None, config: StepConfig, rates: MachineRates, *,
                       device: str | torch.device = "cuda", optimizer: str | None = "adamw",
                       param_dtype: torch.dtype = torch.float32,
                       device_seconds: tuple[float, float] | None = None) -> StepTime:
    """Predict one training step's time.

    Args:
        layout: the model in slices (:func:`~offload.planning.planner.slice_layout`, with the
            config's ``num_slices`` and ``compute_dtype``).
        profile: the model's shapes for the batch (:func:`~offload.planning.shapes.profile_layers`):
            operations and boundary activations. ``None`` with ``device_seconds``.
        config: the choices; ``rates``: the machine's.
        device: ``"cuda"`` (copies overlap compute) or ``"cpu"`` (they do not).
        optimizer: as :func:`~offload.estimate_memory` takes it.
        device_seconds: the device's forward and backward time per step where it is known
            (the backward's including the recompute), instead of operations over a rate.

    Raises:
        ValueError: an unknown schedule, neither ``profile`` nor ``device_seconds``, or
            ``resident_slices`` below 0 or above the number of slices.
    """
    resident_count(config.resident_slices, layout.num_slices)
    if config.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {config.schedule!r}")
    if config.clips_gradients and config.schedule == "in-backward":
        raise ValueError("the 'in-backward' schedule cannot clip the gradients: each slice's update starts in "
                         "backward, before their total norm is known")
    if profile is None and device_seconds is None:
        raise ValueError("estimate_step_time needs the model's profile or the device's seconds")
    moved = traffic(layout, profile, config, optimizer)
    runs = layout.num_slices * config.num_microbatches * rates.slice_overhead_s
    if device_seconds is not None:
        forward_device, backward_device = device_seconds
        # The recompute repeats the forward (all of it, to within the last slice's kept graph).
        compute = backward_device
    else:
        assert profile is not None
        rate = rates.flops_for(str(config.compute_dtype or param_dtype).removeprefix("torch."))
        forward_device = profile.forward_flops / rate
        recompute = profile.recomputed_flops(layout.ranges, config.num_microbatches)
        backward_device = (recompute + profile.backward_flops) / rate
        compute = (profile.forward_flops + profile.backward_flops) / rate
    on_gpu = torch.device(device).type == "cuda"
    # On a CPU "device" the resident slices' copies and update are the host's, at its rates. Their
    # copies' bytes are counted read plus written, as a device's memory bandwidth counts them;
    # ``host_copy`` counts each copied byte once (read and written), so twice it is that bandwidth:
    # a resident slice's load then costs what a streamed slice's load of the same bytes costs.
    device_copy = (rates.device_memory_bandwidth or DEVICE_MEMORY_BANDWIDTH_DEFAULT) if on_gpu else 2 * rates.host_copy
    device_update = moved.device_update / (device_copy if on_gpu else rates.host_update)
    # The resident slices' slot copies and gradient copies run on the compute stream, in the phase
    # they belong to (the gradients' in backward); the forward loads each slice once.
    k = config.resident_slices
    forward_copies = sum(layout.tensor_bytes[j] + layout.device_bytes[j] for j in range(k))
    backward_copies = moved.device_copies - forward_copies
    forward_compute = forward_device + runs + forward_copies / device_copy
    backward_compute = backward_device + 2 * runs + backward_copies / device_copy
    staging = _staging(moved, layout, rates)
    forward, backward, load, offload = _phases(moved, forward_compute, backward_compute, rates, on_gpu, staging)
    update, disk_read, disk_write = _update(moved, rates)
    clip, update = _clip_and_update(config, layout, rates, backward, update, optimizer)
    d2h = rates.device_to_host if on_gpu else None
    streamed = [0] * k + list(layout.gradient_bytes[k:])  # a resident slice has no host update
    exposed = exposed_update(config.schedule, forward, backward, update, streamed, d2h,
                             device_update=device_update, update_waits=not on_gpu)
    return StepTime(compute=compute, forward_compute=forward_compute, backward_compute=backward_compute,
                    load=load, offload=offload, update=update, disk_read=disk_read, disk_write=disk_write,
                    forward=forward, backward=backward, exposed_update=exposed, staging=sum(staging),
                    step=forward + backward + device_update + exposed + clip, device_update=device_update, clip=clip)


def _clip_and_update(config: StepConfig, layout: SliceLayout, rates: MachineRates, backward: float,
                     update: float, optimizer: str | None) -> tuple[float, float]:
    """The clip's seconds on the training thread and the host update's: the norms, then the
    scaling, added once: to the clip, or to the update with ``scale_in_update`` (each slice's
    update does it: Note: [Scaling in the update]), where the one-pass kernel, writing the shadow
    in the update, multiplies the gradients as it reads them and only writes them back."""
    if not config.clips_gradients:
        return 0.0, update
    k = config.resident_slices
    norms = _norm_seconds(layout, k, rates, backward if config.norms_in_backward else None)
    if not config.scale_in_update or config.masters == "disk":  # gradients in files are scaled at the clip
        return norms + _scaling_seconds(layout, k, rates), update
    # Where the one-pass kernel runs (host_bytes.py's count), with a shadow or not: every optimizer it
    # knows is one the kernel serves.
    folded = host_bytes.SHADOW_IN_UPDATE and optimizer is not None
    return norms, update + _scaling_seconds(layout, k, rates, passes=1 if folded else 2)


def _norm_seconds(layout: SliceLayout, resident: int, rates: MachineRates, backward: float | None = None) -> float:
    """The norms of ``offload.clip_grad_norm_`` over the streamed slices' host gradients: on several
    threads, a tensor on one (the largest bounds it: Note: [Norms on several threads]). A resident
    slice's gradients are on the device, where they are quick. With ``backward`` (seconds), the
    norms run in backward instead, a slice at a time as each lands, the first streamed slice last
    (Note: [Norms from backward]): the step waits for that slice's norms, or for what backward is
    too short to cover."""
    host_gradients = sum(layout.gradient_bytes[resident:])
    if backward is None:
        largest = max(layout.largest_gradient_bytes[resident:], default=0)
        return max(largest / rates.host_norm_rate, host_gradients / rates.host_memory)
    per_slice = [max(largest / rates.host_norm_rate, nbytes / rates.host_memory)
                 for largest, nbytes in zip(layout.largest_gradient_bytes[resident:], layout.gradient_bytes[resident:])]
    return max(per_slice[0] if per_slice else 0.0, sum(per_slice) - backward)


def _scaling_seconds(layout: SliceLayout, resident: int, rates: MachineRates, passes: int = 2) -> float:
    """The clip's scaling of the streamed slices' host gradients: each read and written once (a
    pass of its own), or written back only (``passes=1``: the update reads them anyway)."""
    return passes * sum(layout.gradient_bytes[resident:]) / rates.host_memory


def exposed_update(schedule: str, forward: float, backward: float, update: float, gradient_bytes: Sequence[int],
                   device_to_host: float | None, *, device_update: float = 0.0, update_waits: bool = False) -> float:
    """What of the host update (``update`` seconds) a step waits for under ``schedule``, given its
    forward's and backward's lengths and each slice's gradient bytes on their way to the host update
    (0 for a resident or frozen slice; ``device_to_host``: the link's rate, ``None`` on a CPU
    "device"). ``device_update``: the resident slices' update, which the device runs in ``step()``
    before the next forward; ``update_waits``: the host update starts only after it (a CPU
    "device", where both run in the calling thread)."""
    if schedule == "overlapped":
        return exposed_overlapped(gradient_bytes, forward, update, start=0.0 if update_waits else device_update)
    if schedule == "in-backward":
        return exposed_in_backward(gradient_bytes, backward, update, device_to_host, forward=forward,
                                   start=device_update)
    return update


def exposed_overlapped(gradient_bytes: Sequence[int], forward: float, update: float, start: float = 0.0) -> float:
    """What a step waits for the update started at ``step()`` (``"overlapped"``, the default): a
    per-slice simulation. The worker updates the slices in order, each ``update`` shared by
    gradient bytes; the next forward, starting ``start`` seconds after the update (the device's
    own update of resident slices before it), runs slice *k* (an equal share of ``forward``) once
    slice *k - 1* has run and slice *k*'s update is done (at once for a slice without gradients).
    For equal slices that is the longer of one slice's update (slice 0 waits for its own) and the
    update plus one slice's forward, less the forward."""
    total = sum(gradient_bytes)
    if not total or not update:
        return 0.0
    share = forward / len(gradient_bytes)
    updated, ran = 0.0, start
    for grad_bytes in gradient_bytes:
        updated += update * grad_bytes / total
        ran = max(ran, updated) + share
    return max(0.0, ran - start - forward)


def exposed_in_backward(gradient_bytes: Sequence[int], backward: float, update: float,
                        device_to_host: float | None, *, forward: float = 0.0, start: float = 0.0) -> float:
    """What a step waits for the update when backward starts each slice's (``"in-backward"``;
    Note: [Update in backward] in ``offload/optimizing/in_backward.py``): a per-slice simulation.

    Backward runs the slices last to first, each an equal share of the backward's time before its
    gradients (``gradient_bytes[k]``) cross the link (``device_to_host`` bytes/s; ``None`` on a CPU
    "device", whose offloads are in that share already), so slice 0's land as the backward ends.
    The worker takes the updates first in, first out, each ``update`` shared by gradient bytes,
    starting one when its gradients have landed and the one before it is done; a slice without
    gradients (resident, or frozen) gives it nothing. The next forward starts ``start`` seconds
    after the backward (the resident slices' update on the device), runs the leading slices
    without gradients (an equal share of ``forward`` each) and then waits for the first slice's
    update, queued last: the step waits until the worker is through. That is about one slice's
    update when the worker keeps up with backward, and the update less the backward after the
    first slice landed when it does not.

    Not modelled: slices whose update waits for ``step()`` (a weight tied across slices, a gradient
    hook: ``deferred``), ``max_backlog``, and the update's and backward's copies sharing the host's memory.
    """
    total = sum(gradient_bytes)
    n = len(gradient_bytes)
    if not total or not update:
        return 0.0
    first = next(k for k, g in enumerate(gradient_bytes) if g)
    # The backward's last offload, slice 0's, which nothing hides (none when it has no gradients).
    tail = gradient_bytes[0] / device_to_host if device_to_host else 0.0
    share = (backward - tail) / n  # one slice's backward, its offload left out
    worker_free = 0.0
    for j, k in enumerate(reversed(range(n))):  # slice n-1 lands first, slice 0 last
        if not gradient_bytes[k]:
            continue
        landed = (j + 1) * share + (gradient_bytes[k] / device_to_host if device_to_host else 0.0)
        worker_free = max(worker_free, landed) + update * gradient_bytes[k] / total
    return max(0.0, worker_free - backward - start - forward * first / n)


def _staging(moved: _Traffic, layout: SliceLayout, rates: MachineRates) -> tuple[float, float]:
    """Per phase, the seconds its loads take to read their masters from the disk and cast them
    (``shadows="disk"``): on a host worker, a slice ahead, while the device computes the slice
    before. Not modelled: the host update's own disk traffic, which overlaps the next forward,
    sharing the disk."""
    if not (moved.forward_staged or moved.backward_staged):
        return 0.0, 0.0
    if rates.disk_read is None:
        raise ValueError(f"{rates.name}: no disk rates to time the loads' reads of the masters with; run "
                         "`python -m offload calibrate --dir DIR` with DIR where the masters would live")
    # The cast reads the masters in RAM and writes the shadow: the shadow's bytes over the host's
    # memory bandwidth, on top of the masters' read from the disk.
    ratio = sum(layout.device_bytes) / max(sum(layout.host_bytes), 1)
    return tuple(b / rates.disk_read + (1 + ratio) * b / rates.host_memory  # type: ignore[return-value]
                 for b in (moved.forward_staged, moved.backward_staged))


def _phases(moved: _Traffic, forward_compute: float, backward_compute: float, rates: MachineRates,
            overlaps: bool, staging: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float, float, float]:
    """Forward and backward lengths, and the link's time each way; ``staging``: each phase's
    loads' reads from the disk and casts, a slice ahead: they overlap the device's compute and
    the copy of the slice cast before."""
    h2d, d2h = rates.host_to_device, rates.device_to_host
    if not overlaps:
        # A CPU "device": every copy is a copy in RAM, in the calling thread.
        h2d = d2h = rates.host_copy
    loads = (moved.forward_loads / h2d, moved.backward_loads / h2d)
    offloads = (moved.forward_offloads / d2h, moved.backward_offloads / d2h)
    if overlaps:
        forward = max(forward_compute, loads[0], staging[0], offloads[0]) + moved.first_load / h2d
        backward = max(backward_compute, loads[1], staging[1], offloads[1]) + moved.last_offload / d2h
    else:
        forward = forward_compute + loads[0] + offloads[0] + staging[0]
        backward = backward_compute + loads[1] + offloads[1] + staging[1]
    return forward, backward, sum(loads), sum(offloads)


def _update(moved: _Traffic, rates: MachineRates) -> tuple[float, float, float]:
    """The host update's length (disk included), and the disk's reads and writes."""
    update = moved.update / rates.host_update + moved.shadow / rates.host_memory
    if not (moved.disk_read or moved.disk_write):
        return update, 0.0, 0.0
    if rates.disk_read is None or rates.disk_write is None:
        raise ValueError(f"{rates.name}: no disk rates to time the disk tier with; run `python -m offload calibrate "
                         f"--dir DIR` with DIR where the tier would live")
    read, write = moved.disk_read / rates.disk_read, moved.disk_write / rates.disk_write
    return max(update, read, write), read, write
