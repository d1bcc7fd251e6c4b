"""``estimate_memory``: the host RAM, pinned RAM, device and disk bytes a configuration will take,
predicted from parameter counts and dtypes before anything is allocated.

It predicts what :meth:`OffloadModel.memory_footprint() <offload.OffloadModel.memory_footprint>`
reports in the steady state of training with :class:`~offload.OffloadOptimizer` (after the first
step, ``.grad`` kept or not), in the same categories, so the two can be compared line by line
(``tests/test_memory.py`` checks them against each other and against the process's resident set).
What it cannot know is left out, as the footprint leaves it out: activations unless given (a
``profile`` of the model's shapes, or ``activation_bytes``), the caching allocators' reserve,
PyTorch's own memory. :func:`slice_layout`, the model cut into slices in bytes, is what the step
time's estimate (``timing.py``) counts too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..arguments import resident_count
from .footprint import MemoryFootprint
from .estimate_settings import check_dtypes, check_places, check_settings, state_elements
from .landing_pool import landing_pool
from .layout import SliceLayout, exact_size
from .shapes import ModelProfile
from ..walk.slicing import partition
from ..streams.pinned import size_class
from ..streams.flat_views import ALIGN_ELEMENTS, ALIGNMENT, BUFFER_REGION_ALIGNMENT
from ..streams.gradient_places import sparse_parameters
from ..streams.host_storage import _running_stat_modules as running_stat_modules, keeping_their_dtype
from ..streams.quantized import state_tensors
from ..streams.shadow_staging import STAGING_BUFFERS
from ..tiers.state_slice import file_nbytes
from ..tiers.state_window import most_at_once, place



@dataclass(frozen=True)
class _Tensor:
    numel: int
    dtype: torch.dtype
    is_parameter: bool
    #: A parameter that requires grad: only these have a ``.grad``, gradient buffers and optimizer
    #: state (a LoRA model's frozen base has none of the three).
    trainable: bool = True
    #: A tensor of a 4-bit weight's quantisation state, laid out after the parameters and before the
    #: buffers, in its own dtype (Note: [Quantized weights] in ``offload/streams/quantized.py``).
    companion: bool = False
    #: What makes two of these one tensor (a weight tied across layers is registered in each);
    #: ``None``: this one alone (a count).
    key: object = None
    #: For a parameter an earlier slice holds (a weight tied across slices), that slice's index:
    #: this slice's slot has a place for it, and nothing else does (Note: [Tied parameters across
    #: slices] in ``offload/streams/host_storage.py``). ``None``: held here.
    holder: int | None = None
    #: A parameter of a layer whose parameters keep their own dtype under a compute dtype (a batch
    #: or instance norm: ``FLOAT32_LAYERS`` in ``offload/streams/host_storage.py``); as there, a
    #: tensor is kept when any layer of the slice that registers it is such a layer.
    keeps_dtype: bool = False
    #: A parameter whose gradient comes sparse (``nn.Embedding(sparse=True)``): it takes no room
    #: in the gradient buffers (Note: [Sparse gradients take no room] in ``gradient_places.py``).
    sparse_gradient: bool = False
    #: A 0-d tensor (a learnable scale): the disk tier keeps such a parameter's state in RAM, out of
    #: its files (``goes_to_disk`` in ``offload/tiers/state_slice.py``).
    scalar: bool = False

    @property
    def borrowed(self) -> bool:
        return self.holder is not None


def estimate_memory(layers: nn.Module | Sequence[int], *, num_slices: int = 8,
                    param_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None,
                    optimizer: str | None = "adamw", optimizer_state: str = "ram", masters: str = "ram",
                    num_microbatches: int = 1, device: str | torch.device = "cuda",
                    activation_bytes: int = 0, profile: ModelProfile | None = None,
                    resident_slices: int = 0, shadows: str = "ram", amsgrad: bool = False) -> MemoryFootprint:
    """Predict the memory an OffloadModel trained by OffloadOptimizer holds, by category.

    Args:
        layers: an ``nn.Sequential`` (sliced as :class:`~offload.OffloadModel` slices it, each tensor
            in its own dtype; parameters that do not require grad, a LoRA model's frozen base, get no
            gradient or optimizer state; nothing is allocated or changed), the parameter count of each
            layer, in ``param_dtype``, or the model's (an ``int``: ``num_slices`` equal slices).
        num_slices: as :class:`~offload.OffloadModel` takes it.
        param_dtype: dtype of the counted parameters (ignored for a module).
        compute_dtype: as :class:`~offload.OffloadModel` takes it: adds a shadow in that dtype
            on the host, and device slots in it (every floating-point parameter is counted in it
            but those of batch and instance norms, which keep their own dtype as the model keeps
            them; a slice with nothing to cast has no shadow).
        optimizer: ``"adamw"``/``"adam"`` (two moments), ``"sgd-momentum"`` (one buffer),
            ``"sgd"`` or ``None`` (no state).
        amsgrad: Adam's or AdamW's ``amsgrad=True``: a third state tensor, ``max_exp_avg_sq``, as
            large as each trained parameter (in RAM, on disk or on the device with the others).
        optimizer_state: ``"ram"``, or ``"disk"`` to count the optimizer state on disk.
        masters: ``"ram"``, or ``"disk"`` to count the masters on disk, as ``OffloadModel(...,
            masters=DiskTier(path))`` keeps them (it needs ``compute_dtype``: the shadow, which loads
            read, stays in RAM), with the gradients in files beside them. Their files count as
            ``disk``; the window counts three slices' masters and gradients, in RAM while the
            optimizer steps (between steps none are).
        shadows: ``"ram"``, or ``"disk"`` (with ``masters="disk"``), as ``OffloadModel(...,
            shadows="disk")`` keeps them: no shadow per slice, a staging window of two buffers of
            the largest streamed slice's shadow instead (counted as ``host_shadows``; Note:
            [Shadows on disk] in ``offload/streams/shadow_staging.py``).
        num_microbatches: more than one adds the two device buffers that sum gradients.
        device: the compute device; host memory is pinned only for ``"cuda"``, and pooled pinned
            buffers (the gradients' and activations') are counted at their size class, as the
            pool allocates them; nothing needs CUDA to estimate it. On ``"cpu"`` the device
            categories are host memory too.
        activation_bytes: pooled buffers of one step besides those ``profile`` counts; with
            ``offload_activations``, add the saved tensors of the offloaded slices (what
            ``benchmarks/bench_activations.py`` reports as ``host_activation_bytes_after_forward``).
            The copies of a slice's buffers that its checkpointed runs keep where a normalisation
            layer updates running statistics (in training mode, as the layers are passed) are
            counted without it; those of another layer that changes its buffers are not.
        profile: the model's :class:`~offload.planning.shapes.ModelProfile` for the batch
            (:func:`~offload.planning.shapes.profile_layers`): counts the boundary activations
            on the host and the activations' peak on the device (``device_activations``).
        resident_slices: as :class:`~offload.OffloadModel` takes it: the first slices' parameters and
            buffers (in their own dtype), gradients and optimizer state count on the device
            (``device_resident``, ``device_resident_gradients``, ``device_resident_optimizer_state``),
            not as host masters, shadows, gradients, optimizer state or disk (Note: [Resident slices]
            in ``offload/streams/resident_storage.py``).

    Returns:
        A :class:`~offload.MemoryFootprint` of the predicted bytes (``device_gradients`` counts a
        slice's gradients while they are produced too, which the measured footprint, counting only
        persistent buffers, leaves out). ``host_total`` is the host RAM, ``pinned_bytes`` the
        pinned part of it, ``device_total`` and ``disk`` the rest.

    Raises:
        TypeError: ``layers`` is none of the three, or ``num_slices``, ``num_microbatches``,
            ``activation_bytes`` or ``resident_slices`` is not an int.
        ValueError: what :class:`~offload.OffloadModel` refuses (``num_slices`` or
            ``num_microbatches`` below 1, a ``compute_dtype`` other than bfloat16 or float16,
            ``resident_slices`` below 0 or above the number of slices; under a ``compute_dtype``, a
            batch or instance norm in neither float32 nor it, a parameter narrower than it), an unknown optimizer or
            place, ``amsgrad`` with an optimizer other than Adam or AdamW, no parameters, a negative
            count or ``activation_bytes``.

    Example::

        >>> plan = offload.estimate_memory([7_000_000] * 32, num_slices=8, compute_dtype=torch.bfloat16)
        >>> plan.host_total / 2**30, plan.per_parameter()["host_masters"]
    """
    check_settings(num_slices, num_microbatches, activation_bytes, compute_dtype)
    check_places(optimizer, optimizer_state, masters, compute_dtype, shadows, amsgrad)
    check_dtypes(layers, compute_dtype, num_slices)
    layout = slice_layout(layers, num_slices=num_slices, param_dtype=param_dtype, compute_dtype=compute_dtype,
                          optimizer=optimizer, amsgrad=amsgrad)
    return footprint_of(layout, profile, compute_dtype=compute_dtype, optimizer_state=optimizer_state,
                        masters=masters, num_microbatches=num_microbatches, device=device,
                        activation_bytes=activation_bytes, resident_slices=resident_slices, shadows=shadows)


def footprint_of(layout: SliceLayout, profile: ModelProfile | None = None, *, compute_dtype: torch.dtype | None = None,
                 optimizer_state: str = "ram", masters: str = "ram", num_microbatches: int = 1,
                 device: str | torch.device = "cuda", activation_bytes: int = 0,
                 resident_slices: int = 0, shadows: str = "ram") -> MemoryFootprint:
    """:func:`estimate_memory` of a model already cut into slices (``layout``, with the same
    ``compute_dtype`` and optimizer): what the planner calls for each configuration it tries."""
    resident = resident_count(resident_slices, layout.num_slices)
    activations = _activations(layout, profile, num_microbatches, activation_bytes)
    return _footprint(layout, _placed(layout, optimizer_state, masters, resident), activations,
                      compute_dtype=compute_dtype, num_microbatches=num_microbatches,
                      pinned=torch.device(device).type == "cuda", resident=resident, shadows=shadows)


def footprints_by_resident(layout: SliceLayout, profile: ModelProfile | None = None, *,
                           compute_dtype: torch.dtype | None = None, optimizer_state: str = "ram", masters: str = "ram",
                           num_microbatches: int = 1, device: str | torch.device = "cuda",
                           activation_bytes: int = 0, shadows: str = "ram") -> list[MemoryFootprint]:
    """:func:`footprint_of` for each count of resident slices, 0 to all of them (index: the count)."""
    activations = _activations(layout, profile, num_microbatches, activation_bytes)
    pinned = torch.device(device).type == "cuda"
    return [_footprint(layout, _placed(layout, optimizer_state, masters, k), activations, compute_dtype=compute_dtype,
                       num_microbatches=num_microbatches, pinned=pinned, resident=k, shadows=shadows)
            for k in range(layout.num_slices + 1)]


def resident_device_bytes(layout: SliceLayout) -> list[int]:
    """Per slice, the device bytes that keeping it resident adds: its parameters and buffers, its
    gradients and its optimizer state (what it then no longer holds on the host)."""
    return [t + g + s for t, g, s in zip(layout.tensor_bytes, layout.trainable_bytes, layout.state_bytes)]


def _footprint(layout: SliceLayout, placed: tuple[int, int, int, int, bool], activations: tuple[int, int], *,
               compute_dtype: torch.dtype | None, num_microbatches: int, pinned: bool,
               resident: int = 0, shadows: str = "ram") -> MemoryFootprint:
    masters_bytes, state, disk, disk_window, gradients_on_disk = placed
    # Gradients landing and being added (Note: [Gradients added in place]): two buffers of the
    # largest streamed slice's size, one when a single slice has gradients (a frozen base around
    # it); pinned ones are rounded up to their size class, as the pool allocates them, and so are
    # those that stay as .grad: views of such a buffer, they keep it whole. A resident slice's
    # gradients stay on the device: they take no host buffer.
    sized = size_class if pinned else exact_size
    host_activations = activations[0] + _buffer_snapshots(layout, num_microbatches, sized)
    device_activations = activations[1]
    grads = [sized(b) for b in layout.host_gradient_bytes(resident)] or [0]
    window = landing_pool([sized(b) for b in layout.landing_bytes(resident)],
                           layout.tied_on_host(resident, gradients_on_disk))
    # Only a slice whose load casts has a shadow (SliceLayout.casts).
    streamed = [b for b, casts in zip(layout.load_bytes[resident:], layout.casts[resident:]) if casts] or [0]
    # Note: [Shadows on disk]: a staging window in place of a shadow per streamed slice.
    staged = STAGING_BUFFERS * max(streamed) if resident < layout.num_slices else 0
    shadow_bytes = (staged if shadows == "disk" else sum(streamed)) if compute_dtype else 0
    # With masters on disk, a slice whose load casts nothing has no files: its gradients stay in RAM.
    in_ram = [g for g, c in zip(grads, layout.casts[resident:] or [False]) if not c]
    gradients = sum(in_ram) + layout.tied_gradients_off_file(resident, sized) if gradients_on_disk else sum(grads)
    pool = window + host_activations
    return MemoryFootprint(
        parameters=layout.parameters,
        host_masters=masters_bytes,
        host_shadows=shadow_bytes,
        host_gradients=gradients,
        host_optimizer_state=state,
        host_disk_window=disk_window,
        host_activations=host_activations,
        host_pool_idle=window,
        host_pool=gradients + pool,
        device_slots=min(2, layout.num_slices) * max(layout.device_bytes),
        # A slice's gradients as autograd produces them, before they leave (held, or summed in two
        # buffers over microbatches): memory.md, "Device". Resident slices' pass through them too.
        device_gradients=(3 if num_microbatches > 1 else 1) * max(layout.landing_bytes()),
        device_activations=device_activations,
        pinned=pinned,
        pinned_bytes=masters_bytes + shadow_bytes + gradients + pool if pinned else 0,
        disk=disk,
        # Note: [Resident slices]: each tensor, and each gradient, an allocation of its own in its
        # own dtype; the state as on the host.
        device_resident=sum(layout.tensor_bytes[:resident]),
        device_resident_gradients=sum(layout.trainable_bytes[:resident]),
        device_resident_optimizer_state=sum(layout.state_bytes[:resident]),
    )


def slice_layout(layers: nn.Module | Sequence[int] | int, *, num_slices: int = 8,
                 param_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype | None = None,
                 optimizer: str | None = "adamw", amsgrad: bool = False) -> SliceLayout:
    """Cut ``layers`` (as :func:`estimate_memory` takes them) into slices and count each slice's bytes."""
    states = state_elements(optimizer, amsgrad)
    layers = _as_layers(layers, num_slices)
    per_layer = _layers(layers, param_dtype)
    if not any(t.is_parameter for layer in per_layer for t in layer):
        raise ValueError("estimate_memory needs layers with parameters")
    # As OffloadModel slices: by the bytes of the parameters and buffers a layer registers.
    sizes = [sum(t.numel * t.dtype.itemsize for t in layer if not t.companion) for layer in per_layer]
    ranges = partition(sizes, num_slices)
    slices = _held_once([[t for k in r for t in per_layer[k]] for r in ranges])

    def device_dtype(t: _Tensor) -> torch.dtype:
        # As SliceStorage decides each device copy's dtype: a batch or instance norm's parameters
        # keep theirs, so a slice of those alone casts nothing (no shadow, no masters' file).
        cast = t.is_parameter and t.dtype.is_floating_point and not t.keeps_dtype
        return compute_dtype if compute_dtype is not None and cast else t.dtype

    own = [[t for t in s if not t.borrowed] for s in slices]
    trained = [[t for t in s if t.is_parameter and t.trainable] for s in own]
    cast = [[t for t in s if device_dtype(t) != t.dtype] for s in trained]
    return SliceLayout(
        ranges=ranges,
        host_bytes=[_laid_out(s, lambda t: t.dtype) for s in own],
        # A slot holds the slice in its device layout, buffers included, then what it borrows.
        device_bytes=[_laid_out(s, device_dtype) for s in slices],
        gradient_bytes=[sum(_align(t.numel * t.dtype.itemsize, ALIGNMENT) for t in s) for s in trained],
        sparse_gradient_bytes=[sum(_align(t.numel * t.dtype.itemsize, ALIGNMENT) for t in s if t.sparse_gradient)
                               for s in trained],
        state_bytes=[sum(states * t.numel * t.dtype.itemsize for t in s) for s in trained],
        tensor_bytes=[sum(t.numel * t.dtype.itemsize for t in s) for s in own],
        trainable_bytes=[sum(t.numel * t.dtype.itemsize for t in s) for s in trained],
        trainable_counts=[sum(t.numel for t in s) for s in trained],
        parameters=sum(t.numel for s in own for t in s if t.is_parameter),
        trainable=sum(t.numel for s in trained for t in s),
        computed_gradient_bytes=[sum(t.numel * device_dtype(t).itemsize for t in s) for s in trained],
        state_file_bytes=[file_nbytes([t.numel * t.dtype.itemsize for t in s if not t.scalar for _ in range(states)])
                          for s in trained],
        largest_gradient_bytes=[max((t.numel * t.dtype.itemsize for t in s), default=0) for s in trained],
        # The shadow holds what a load copies from the slice's own host copy: not what it borrows.
        load_bytes=[_laid_out(s, device_dtype) for s in own],
        casts=[any(device_dtype(t) != t.dtype for t in s) for s in own],
        borrowed_gradients=_borrowed_gradients(slices),
        borrowed_weights=_borrowed_weights(slices),
        cast_gradient_bytes=[sum(_align(t.numel * t.dtype.itemsize, ALIGNMENT) for t in s) for s in cast],
        cast_trainable_bytes=[sum(t.numel * t.dtype.itemsize for t in s) for s in cast],
        layer_gradient_bytes=_layer_gradient_bytes(per_layer, device_dtype),
        lent_gradient_bytes=_lent_gradient_bytes(slices),
        snapshot_bytes=_snapshot_bytes(layers, own, ranges),
        scalar_state_bytes=[sum(states * t.numel * t.dtype.itemsize for t in s if t.scalar) for s in trained],
    )


def _as_layers(layers: nn.Module | Sequence[int] | int, num_slices: int) -> nn.Module | Sequence[int]:
    """``layers`` as :func:`_layers` takes them: a parameter count alone as the model cut into
    ``num_slices`` equal slices."""
    if isinstance(layers, int) and not isinstance(layers, bool):
        if layers < 1:
            raise ValueError(f"estimate_memory needs a positive parameter count, got {layers}")
        return [layers // num_slices + (k < layers % num_slices) for k in range(num_slices)]
    return layers


def _layer_gradient_bytes(per_layer: list[list[_Tensor]], device_dtype: Callable[[_Tensor], torch.dtype]) -> list[int]:
    seen: set[object] = set()
    result = []
    for layer in per_layer:
        trained = [t for t in layer if t.is_parameter and t.trainable and not t.sparse_gradient
                   and (t.key is None or t.key not in seen)]
        seen.update(t.key for t in trained)
        result.append(sum(t.numel * device_dtype(t).itemsize for t in trained))
    return result


def _sends_borrowed_gradient(t: _Tensor) -> bool:
    """A trainable weight an earlier slice holds, whose gradient this slice computes and sends dense."""
    return t.holder is not None and t.is_parameter and t.trainable and not t.sparse_gradient


def _borrowed_gradients(slices: list[list[_Tensor]]) -> list[list[tuple[int, int]]]:
    """Per slice, (holder's index, aligned gradient bytes) of each trainable weight it borrows."""
    return [[(t.holder, _align(t.numel * t.dtype.itemsize, ALIGNMENT)) for t in tensors if _sends_borrowed_gradient(t)]
            for tensors in slices]


def _borrowed_weights(slices: list[list[_Tensor]]) -> list[list[int]]:
    """Per slice, beside each of :func:`_borrowed_gradients`, the number of the weight it borrows (in
    the order the model first borrows them): two weights of one holder are two sums."""
    numbers: dict[object, int] = {}
    return [[numbers.setdefault(t.key, len(numbers)) for t in tensors if _sends_borrowed_gradient(t)]
            for tensors in slices]


def _lent_gradient_bytes(slices: list[list[_Tensor]]) -> list[int]:
    """Per slice, the aligned gradient bytes of the trainable weights it holds that a later slice
    borrows."""
    lent = {t.key for tensors in slices for t in tensors if t.borrowed}
    return [sum(_align(t.numel * t.dtype.itemsize, ALIGNMENT) for t in tensors
                if not t.borrowed and t.is_parameter and t.trainable and t.key is not None and t.key in lent)
            for tensors in slices]


def _snapshot_bytes(layers: nn.Module | Sequence[int], own: list[list[_Tensor]], ranges: list[range]) -> list[int]:
    """Per slice, its buffer region's bytes where a layer of it updates running statistics in
    training, in the mode the layers are in now (the model's own test:
    ``SliceStorage.has_running_stats_in_training``), else 0 (SliceLayout.snapshot_bytes). Parameter
    counts have no buffers."""
    if not isinstance(layers, nn.Module):
        return [0] * len(ranges)
    updating = [any(m.training for m in running_stat_modules([layer])) for layer in _children(layers)]
    return [_laid_out([t for t in s if not t.is_parameter and not t.companion], lambda t: t.dtype)
            if any(updating[k] for k in r) else 0 for s, r in zip(own, ranges)]


def _held_once(slices: list[list[_Tensor]]) -> list[list[_Tensor]]:
    """Each slice's tensors, each once, those an earlier slice holds marked borrowed: as
    OffloadModel holds a weight tied across slices, once, in the first slice that registers it
    (Note: [Tied parameters across slices] in ``offload/streams/host_storage.py``)."""
    held: dict[object, int] = {}  # key -> the slice that holds it
    result = []
    for k, tensors in enumerate(slices):
        mine: dict[object, _Tensor] = {}
        for t in tensors:
            key = id(t) if t.key is None else t.key
            mine.setdefault(key, dataclasses.replace(t, holder=held[key]) if key in held else t)
            if t.keeps_dtype and not mine[key].keeps_dtype:  # registered by a batch norm of this slice too
                mine[key] = dataclasses.replace(mine[key], keeps_dtype=True)
            if mine[key].sparse_gradient and not t.sparse_gradient:  # and read densely in this slice
                mine[key] = dataclasses.replace(mine[key], sparse_gradient=False)
        for key in mine:
            held.setdefault(key, k)
        result.append(list(mine.values()))
    return result


def _placed(layout: SliceLayout, optimizer_state: str, masters: str, resident: int = 0
            ) -> tuple[int, int, int, int, bool]:
    """Masters and state in RAM, bytes on disk, and the disk tiers' window in RAM, of the slices
    after the first ``resident`` (those hold theirs on the device); and whether the gradients are
    on disk."""
    host_bytes, state_bytes = layout.host_bytes[resident:] or [0], layout.state_bytes[resident:] or [0]
    masters_bytes, state = sum(host_bytes), sum(state_bytes)
    disk = disk_window = 0
    window_slices = min(3, layout.num_slices - resident)
    if optimizer_state == "disk":
        # The tier's files: one per slice with state, each tensor at 64 bytes, in whole pages. Its
        # window: three consecutive slices' state being read, updated and written, one arena with a
        # place per slice (Note: [The window's arena]); it serves only slices with state, so one
        # without parameters, or frozen, does not count among the three. A 0-d parameter's state
        # stays in RAM (SliceLayout.scalar_state_bytes).
        files = layout.state_file_bytes[resident:]
        disk, disk_window, state = sum(files), place([f for f in files if f])[1], _scalar_state(layout, resident)
    if masters == "disk":
        # One file per slice, in whole pages (offload/streams/mapped.py); three consecutive slices' masters
        # are in RAM while the optimizer steps (Note: [Masters on disk]). Their gradients go to
        # files of their own, read in and written back with them (Note: [Gradients on disk]).
        # Only a slice whose load casts has a file (SliceLayout.casts); the others stay in RAM.
        casts = layout.casts[resident:] or [False]
        files = [_align(h, 4096) if c else 0 for h, c in zip(host_bytes, casts)]
        gradient_files = [_align(g, 4096) if g and c else 0
                          for g, c in zip(layout.gradient_bytes[resident:] or [0], casts)]
        disk += sum(files) + sum(gradient_files)
        # Each read waits for the write of the slice ``window_slices`` reads before it, in slice
        # order either way; only updated slices (with gradients) are read: the window holds the
        # most that many consecutive updated slices' files take.
        read = [(f, g) for f, g in zip(files, gradient_files) if g]
        disk_window += (most_at_once([f for f, _ in read], window_slices)
                        + most_at_once([g for _, g in read], window_slices))
        masters_bytes = sum(h for h, c in zip(host_bytes, casts) if not c)
    return masters_bytes, state, disk, disk_window, masters == "disk"


def _activations(layout: SliceLayout, profile: ModelProfile | None, num_microbatches: int,
                 activation_bytes: int) -> tuple[int, int]:
    """Host bytes of one step's boundary activations, and the device's activation peak.

    Host: the input of every slice, whole batch, but the last slice's last microbatch (its graph is
    kept), as ``offload/autograd/records.py`` checkpoints them. Device: the largest over slices of its
    whole-batch input and output (the forward keeps every microbatch's output until the next slice
    runs) and one microbatch's recompute and backward: its graph's saved bytes, its output's gradient
    and the most of a gradient the size of its largest saved tensor, a layer's sum (Note: [Gradients
    summed in backward] in ``shapes.py``) and its forward's transients (Note: [Working bytes beyond
    the saved] in ``working_bytes.py``), those two less the slice's gradients not produced by then
    (``device_gradients`` counts them whole). Large logits need their loss's memory on top."""
    if profile is None:
        return activation_bytes, 0
    inputs = profile.slice_input_bytes(layout.ranges)
    outputs = profile.slice_output_bytes(layout.ranges)
    saved = profile.slice_saved_bytes(layout.ranges)
    host = activation_bytes + profile.checkpointed_bytes(layout.ranges, num_microbatches)
    grads = layout.layer_gradient_bytes or [0] * len(profile.layers)  # a layout made by hand: none
    per_slice = []
    for r, i, o, s, largest in zip(layout.ranges, inputs, outputs, saved, profile.slice_largest_saved(layout.ranges)):
        held = [s + o + largest]  # one microbatch's, then less the gradients not produced yet
        held += [s + o + profile.layers[k].summing for k in r] + [s + o + profile.layers[k].transient for k in r]
        not_yet = [0] + [sum(grads[r.start:k]) for k in r] + [sum(grads[r.start:r.stop])] * len(r)
        per_slice.append(i + o + max(-(-h // num_microbatches) - g for h, g in zip(held, not_yet)))
    return host, max(per_slice)


def _children(layers: nn.Module) -> list[nn.Module]:
    """The layers of a model as OffloadModel cuts them: its children, or the module itself."""
    return list(layers.children()) or [layers]


def _buffer_snapshots(layout: SliceLayout, num_microbatches: int, sized: Callable[[int], int]) -> int:
    """Host bytes of the buffers checkpointed runs keep for their recompute (SliceLayout.snapshot_bytes):
    a region per run of a slice that updates running statistics, every microbatch's but the last
    slice's last, whose graph is kept (as ``checkpointed_bytes`` counts the boundary activations),
    a resident slice's too; each in a pooled buffer of its own, in its size class where pinned."""
    regions = layout.snapshot_bytes
    runs = [num_microbatches] * (len(regions) - 1) + [num_microbatches - 1]
    return sum(sized(region) * n for region, n in zip(regions, runs) if region)


def _scalar_state(layout: SliceLayout, resident: int) -> int:
    """The state the disk tier keeps in RAM: the streamed slices' 0-d parameters'
    (SliceLayout.scalar_state_bytes)."""
    return sum(layout.scalar_state_bytes[resident:])


def _layers(layers: nn.Module | Sequence[int], param_dtype: torch.dtype) -> list[list[_Tensor]]:
    if isinstance(layers, nn.Module):
        result = []
        for layer in _children(layers):
            seen: set[int] = set()
            tensors = []
            # An 8-bit weight that ran keeps its row scales on its layer (Note: [Quantized weights]).
            owners = {id(p): m for m in layer.modules() for p in m._parameters.values() if p is not None}
            kept = keeping_their_dtype([layer])  # the model's own test, so that the two cannot differ
            sparse = sparse_parameters([layer])  # the model's own test too
            for is_parameter, source in ((True, layer.parameters()), (False, layer.buffers())):
                for t in source:
                    if id(t) not in seen:
                        seen.add(id(t))
                        tensors.append(_Tensor(t.numel(), t.dtype, is_parameter,
                                               trainable=is_parameter and t.requires_grad, key=id(t),
                                               keeps_dtype=is_parameter and id(t) in kept,
                                               sparse_gradient=is_parameter and id(t) in sparse,
                                               scalar=t.dim() == 0))
                        tensors += [_Tensor(c.numel(), c.dtype, False, trainable=False, companion=True,
                                            key=(id(t), name))
                                    for name, c in state_tensors(t, f"a parameter of {type(layer).__name__}",
                                                                      owners.get(id(t)))]
            result.append(tensors)
        return result
    if not isinstance(layers, Sequence) or isinstance(layers, str):
        raise TypeError(f"estimate_memory takes an nn.Sequential, a list of each layer's parameter count, or the "
                        f"model's parameter count (an int), got {type(layers).__name__}")
    for k, n in enumerate(layers):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"estimate_memory: layer {k} has {n!r} parameters; each count must be an int >= 0")
    return [[_Tensor(n, param_dtype, True)] if n else [] for n in layers]


def _laid_out(tensors: Sequence[_Tensor], dtype_of) -> int:  # type: ignore[no-untyped-def]
    # As SliceStorage lays a slice out: its parameters, the quantisation states of its 4-bit weights,
    # then its buffers from a region boundary; in a slot, what it borrows after all of them.
    end = 0
    params = [t for t in tensors if t.is_parameter and not t.borrowed]
    companions = [t for t in tensors if t.companion and not t.borrowed]
    buffers = [t for t in tensors if not t.is_parameter and not t.companion and not t.borrowed]
    borrowed = [t for t in tensors if t.borrowed]
    for t in params + companions + buffers + borrowed:
        if buffers and t is buffers[0]:
            end = _align(end, BUFFER_REGION_ALIGNMENT)
        dtype = dtype_of(t)
        align = ALIGN_ELEMENTS * dtype.itemsize
        end = _align(_align(end, align) + t.numel * dtype.itemsize, align)
    return end


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment
