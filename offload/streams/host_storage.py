"""The host copies of one slice: every parameter and buffer in the memory of one flat byte buffer.

The user's ``nn.Parameter`` objects stay the same Python objects; only their ``.data`` is pointed
into the slice's buffer, so an optimizer built on them keeps working and its in-place updates land
where the next load reads them. One flat buffer per slice means a load is one copy, and the buffer
is pinned once for the life of the model. Each tensor still has a storage of its own over its part
of that memory (Note: [A storage per host copy]).

Layout: parameters first, then buffers, each entry aligned to
:data:`~offload.streams.flat_views.ALIGN_ELEMENTS` elements. The device
slot uses the same layout in the *device dtype* of each entry, so a slice without dtype changes
loads with a single byte copy, and the buffers form one contiguous region that can be snapshotted
and written back on its own.

This file holds :class:`SliceStorage`, the tying of a parameter across slices
(:func:`holder_of`), the parameters that keep their dtype under a compute dtype
(:func:`keeping_their_dtype`), and the refusal of tensors over one memory and of parameters whose
elements share one (:func:`check_memory_held_once`); what a compute dtype refuses is in ``dtype_refusals.py``. The
move of each tensor into the buffer, the host copies a loader fills (:func:`filled_by_caller`) and
the undo of a build that raises are in ``take_in.py``; the reads and write-backs of masters on disk
that a storage does itself, and the record a failed write-back leaves, in ``masters_io.py``.
What a slice holds is collected in ``slice_entries.py``, where each entry lies is computed in
``slice_layout.py``; the views into the buffer are made in ``flat_views.py``.

Note: [Tensors that view another's memory]
    A host copy lies in the slice's own buffer: pinned, laid out for one copy per load, the master
    the optimizer updates. A tensor whose ``.data`` views another tensor's memory cannot stay so:
    the flat-parameter pattern (``p.data = flat[a:b].view_as(p)``, an optimizer stepping ``flat``),
    ``torch.nn.utils.vector_to_parameters(vec, params)`` followed by in-place edits of ``vec``, a
    buffer registered as a view of a larger tensor. The layout copies its values and points its
    ``.data`` into the buffer as for any tensor, so later in-place changes to the tensor it viewed
    no longer reach the model, where in plain PyTorch they would: training through ``flat`` stops,
    silently. Whether anything still writes that tensor cannot be told, so the engine warns, once
    per model, naming the tensor and what to do (``Engine.warn_viewed_outside`` in
    ``offload/walk/engine.py``). What counts is :func:`~offload.streams.flat_views.views_outside`:
    a storage larger than the tensor's extent. A ``_base`` alone does not: a view over all of its
    base's memory is what layers register as buffers over bases of their own, and who else holds
    the base cannot be told (``p.data = flat.view_as(p)`` of a whole ``flat`` goes unnoticed). The
    model's own paths never count: a host copy has a storage of exactly its bytes (Note: [A storage
    per host copy]), a tied weight is one tensor, and ``.data`` replaced by a fresh tensor,
    ``load_state_dict``, ``.to()``, ``apply(init)`` and injected adapters bring tensors of their
    own or write in place.

Note: [Parameters over one memory]
    Two distinct tensors over one memory (``head.weight = nn.Parameter(emb.weight)``, a
    ``load_state_dict(..., assign=True)`` whose tied keys share a storage) are one memory in the
    plain model, which an optimizer updates once per ``nn.Parameter``, each with its own gradient.
    A layout gives each a host copy of its own (a tied weight is told by identity: Note: [Tied
    parameters across slices]), so they would drift apart from the first step; one memory for two
    entries would collide in the gradients, shadows and one-pass updates, laid out one an entry.
    So such a pair is refused before anything moves, naming both (:func:`check_memory_held_once`):
    at wrap over the whole model, at each layout within the slice. One of the two at least must be
    an ``nn.Parameter``: buffers over one memory (a mask registered by each layer as a view of one
    tensor) are read, as a rule. Substitutes (below) keep their memory and do not count.

Note: [Parameters whose elements overlap]
    A parameter some of whose elements share one memory location (``nn.Parameter(t.expand(4, 4))``,
    stride 0; an overlapping ``as_strided`` view) is one model in plain PyTorch, which cannot step
    it ("more than one element of the written-to tensor refers to a single memory location"). A
    host copy holds each element apart, so the model would train as another one, with no word. So
    such a parameter is refused, naming it, with the same timing as the pairs above
    (:func:`check_memory_held_once`). Buffers are not: a layer reads them, and the copy holds the
    same values (an expanded mask, positions); the one thing that differs, a layer writing into
    one in place, raises in plain PyTorch for a stride 0 and has an order-dependent result for
    other overlaps, so refusing every such buffer would refuse models that train alike.

Note: [Tensors substituted for a call]
    ``torch.func.functional_call`` (``torch.nn.utils.stateless``) puts the caller's tensors in the
    layers' places for one call, writing ``module._parameters`` directly; ``setattr`` and
    ``register_parameter`` take only an ``nn.Parameter``, so a plain tensor in a parameter's place
    is such a *substitute*. The slice is laid out again around it
    (:meth:`SliceStorage.registered_tensors_changed`) and its values are copied into the host
    buffer, but its ``.data`` is left alone: the caller's tensor keeps its memory, its address and
    its base, as in plain PyTorch. Its gradient reaches it as any parameter's, as an input of the
    autograd Function, never through its memory. Its host copy being a copy, each later forward
    (within the same call: a call's end puts the layers' own tensors back, which lays the slice out
    again anyway) compares the two, bit for bit (a NaN is unchanged), once a forward, and a change
    (an optimizer step on it, a write through its base or its ``.data``) lays the slice out again
    (:func:`substitutes_changed`). Values, not version counters: fused optimizers and
    writes through ``.data`` bump none. Taken in as before, with a
    warning where they view another's memory: a substitute buffer (a layer's writes, BatchNorm's
    running statistics, come back to the host copy, which must be the caller's tensor for the
    caller to see them), one on another device than the host buffer, and every substitute of a
    resident slice (``resident_storage.py`` takes each tensor into device memory of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence

import torch
from torch import nn

from .backend import Event
from .dtype_refusals import refuse_narrow_masters, refuse_norms_in_another_dtype
from .flat_views import _itemsize, alias, first_overlap, overlaps_itself, typed_view, views_outside
from .gradient_files import GradientHome
from .mapped import MappedFile
from .masters_io import Unwritten, read_masters_in, write_masters_back
from .quantized import is_4bit_weight, is_8bit_weight
from .slice_entries import (Entry, RegisteredTensors, _runs, collect_entries, companions_of, run_state_positions,
                            settle_8bit_layers, states_replaced)
from .slice_layout import lay_out
# adopt_meta and filled_by_caller are imported from here (resident_storage.py, offload/loading)
from .take_in import adopt_meta, filled_by_caller, given_back_if_raising, take_in  # noqa: F401


#: Layers whose parameters keep their own dtype under a compute dtype: the batch and instance
#: norms, whose kernels take a half-precision input with float32 weight and running statistics on
#: the CPU and on CUDA alike (cuDNN's batch norm wants exactly that). LayerNorm, GroupNorm and
#: RMSNorm are not among them: on CUDA their kernels refuse a float32 weight with a half input
#: ("expected scalar type BFloat16 but found Float"), so they take the compute dtype, as under
#: ``model.to(dtype)``.
FLOAT32_LAYERS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase,)


def keeping_their_dtype(layers: Sequence[nn.Module]) -> set[int]:
    """Ids of the parameters in ``layers`` whose device copies keep their dtype under a compute
    dtype: those of :data:`FLOAT32_LAYERS`, and bitsandbytes' quantized weights. The test
    :class:`SliceStorage` applies, public so that what predicts the model (``offload/planning``:
    memory, host bytes, step time, shapes) applies the same."""
    kept = {id(p) for layer in layers for m in layer.modules()
            if isinstance(m, FLOAT32_LAYERS) for p in m.parameters(recurse=False)}
    # A 4-bit weight's codes are bytes, whatever dtype holds them: under ``bnb_4bit_quant_storage``
    # (bfloat16 for FSDP-QLoRA) they sit in a floating-point tensor, which a cast would convert as
    # values, scrambling the packed codes or their count. So they travel as stored, as their
    # quantisation state does (Note: [Quantized weights], rule 2); an 8-bit weight's are int8.
    kept.update(id(p) for layer in layers for p in layer.parameters() if is_4bit_weight(p) or is_8bit_weight(p))
    return kept


def _set_device_dtypes(params: Sequence[Entry], layers: Sequence[nn.Module], compute_dtype: torch.dtype | None,
                       wrapping: bool) -> None:
    """Give the floating-point ``params`` the device dtype ``compute_dtype``, but for those
    :func:`keeping_their_dtype`; nothing without one. ``wrapping``: the slice's first layout.

    Raises:
        ValueError: a batch or instance norm holds a floating-point tensor in neither float32 nor
            ``compute_dtype`` (a float64 or float16 model under bfloat16): it keeps its dtype, and
            its kernels take a half-precision input only with float32 weights and statistics or
            the input's dtype. Buffers are not cast on the way (the buffer region is written back
            as bytes), so the model is refused rather than failing in forward. Or, ``wrapping``, a
            parameter narrower than ``compute_dtype``, whose gradients cannot be exact (a float16 one
            under bfloat16: Note: [Masters narrower than the compute dtype] in ``dtype_refusals.py``).
    """
    if compute_dtype is None:
        return
    refuse_norms_in_another_dtype([(path, m) for layer in layers for path, m in layer.named_modules()
                                   if isinstance(m, FLOAT32_LAYERS)], compute_dtype)
    kept = keeping_their_dtype(layers)
    refuse_narrow_masters(params, layers, kept, compute_dtype, wrapping)
    for entry in params:
        if entry.dtype.is_floating_point and id(entry.tensor) not in kept:
            entry.device_dtype = compute_dtype


def check_memory_held_once(layers: Sequence[nn.Module], names: Sequence[str] | None = None) -> None:
    """Refuse two distinct tensors over one memory in ``layers``, one of them at least an
    ``nn.Parameter`` (Note: [Parameters over one memory]), with a ``ValueError`` naming both, and a
    parameter whose elements share memory (Note: [Parameters whose elements overlap]), naming it;
    ``names`` name the layers in it (their classes without it)."""
    found: dict[int, tuple[str, torch.Tensor, bool]] = {}
    for i, layer in enumerate(layers):
        prefix = names[i] if names is not None else type(layer).__name__
        for name, tensor in layer.named_parameters(prefix):
            if isinstance(tensor, nn.Parameter):  # a plain tensor is a substitute: it keeps its memory
                _refuse_overlapping_elements(name, tensor)
                found.setdefault(id(tensor), (name, tensor, True))
        for name, tensor in layer.named_buffers(prefix):
            found.setdefault(id(tensor), (name, tensor, False))
    named = list(found.values())
    pair = first_overlap([tensor for _, tensor, _ in named], [watched for _, _, watched in named])
    if pair is None:
        return
    first, second = (f"{'parameter' if named[i][2] else 'buffer'} '{named[i][0]}'" for i in pair)
    raise ValueError(
        f"{first} and {second} are two tensors over the same memory (as after "
        "head.weight = nn.Parameter(emb.weight)). OffloadModel keeps each parameter and buffer in host memory of "
        "its own, so they would stop sharing it and train apart from the plain model. To tie them, assign the same "
        "nn.Parameter object (head.weight = emb.weight: one tensor, one gradient, one optimizer update); to keep "
        "them apart, give one memory of its own (nn.Parameter(emb.weight.detach().clone()))"
    )


def _refuse_overlapping_elements(name: str, parameter: torch.Tensor) -> None:
    """Refuse ``parameter`` where elements share memory (Note: [Parameters whose elements overlap])."""
    if overlaps_itself(parameter):
        raise ValueError(
            f"parameter '{name}' has elements that share memory (shape {tuple(parameter.shape)}, strides "
            f"{parameter.stride()}, as after .expand()): a plain optimizer cannot step it, and OffloadModel would "
            "hold each element apart, another model. Register a parameter of its own shape (or one with memory of "
            "its own: .contiguous(), .clone()) and expand it in forward"
        )


def _running_stat_modules(layers: Sequence[nn.Module]) -> list[nn.Module]:
    """The normalisation layers in ``layers`` that keep running statistics (see
    :meth:`SliceStorage.has_running_stats_in_training`)."""
    return [m for layer in layers for m in layer.modules()
            if getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None]


def _check_buffers_held_once(buffers: Sequence[Entry], held_elsewhere: Collection[int],
                             layers: Sequence[nn.Module]) -> None:
    """Refuse a buffer that an earlier slice holds too: each slice writes its buffers back, and two
    write-backs would race (Note: [Tied parameters across slices]). The message names the buffer
    from its layer down (``self_attn.q_proj.vera_A.default``): its own name alone is often a key."""
    for entry in buffers:
        if id(entry.tensor) in held_elsewhere:
            site = entry.sites[0]
            layer, path = next(((layer, path) for layer in layers for path, module in layer.named_modules()
                                if module is site.module), (site.module, ""))
            name = f"{path}.{site.name}" if path else site.name
            raise ValueError(
                f"buffer '{name}' is registered in an earlier slice too; a buffer must sit in one slice: pass the "
                f"layers that share it (this one a {type(layer).__name__}) as one element of a list, or use fewer "
                "slices"
            )


#: The integer dtype of each element size, to compare floating-point values bit for bit.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (of one dtype and shape) hold the same bits: NaNs of the same payload
    are equal, ``0.0`` and ``-0.0`` are not."""
    if a.is_complex():
        a, b = torch.view_as_real(a.resolve_conj()), torch.view_as_real(b.resolve_conj())
    if a.is_floating_point():
        a, b = a.view(_BITS[a.element_size()]), b.view(_BITS[b.element_size()])
    return torch.equal(a, b)


def substitutes_changed(storage: SliceStorage) -> bool:
    """Whether a substitute of ``storage``'s differs from its host copy (Note: [Tensors substituted
    for a call]); the caller then lays the slice out again.

    Reads every substitute and its host copy, so the caller asks once a refresh. Bit for bit: a NaN
    equals itself (``torch.equal`` would call it changed at every forward), and a sign of zero
    flipped is a change.
    """
    return any(not _same_bits(entry.tensor.detach(), host) for entry, host in storage.substitutes)


def holder_of(storages: Sequence[SliceStorage], index: int, tensor: torch.Tensor) -> int:
    """The index of the slice before ``index`` that holds ``tensor``, which slice ``index`` borrows
    (Note: [Tied parameters across slices])."""
    return next(i for i in range(index) if storages[i].holds(tensor))


class SliceStorage:
    """Host copies of one slice's parameters and buffers, in one flat (pinned) byte buffer.

    Note: [Tied parameters across slices]
        A parameter registered in several slices (an embedding tied to the output head) is held,
        and updated, by the first slice that registers it; later slices *borrow* it. A borrowing
        slice lays the parameter out in its device slot like its own, after everything a load
        copies from its own host buffer, and its load copies the parameter from the holder's host
        copy (or shadow) as a second copy into that place. Each slice binds its own device copy
        into its own layers and produces its own gradient for it; both are inputs of the
        autograd Function, so autograd adds them into the one ``.grad``, as for any tied weight.
        Optimizers step the parameter once, with the slice that holds it. Buffers cannot be shared
        across slices: each slice writes its buffers back, and two write-backs would race.

    Note: [A storage per host copy]
        Every parameter and buffer a slice holds lies in the slice's flat buffer, but not as a view
        of it: each has a storage of its own (``torch.frombuffer`` over the buffer's memory, see
        :func:`own_storage_view`) that starts at the tensor's first byte and holds exactly its
        bytes. Libraries that save a state dict take tensors that share a storage for tied ones:
        safetensors refuses them, Accelerate's ``save_model`` and ``save_state`` keep one tensor
        per storage and drop the others with a warning, and a resume with ``strict=False`` does
        not notice the missing keys. With a storage per tensor, an offloaded model's state dict
        shares storages exactly where the plain model's does (tied parameters). Nothing is
        allocated or copied twice: loads still copy the flat buffer at once, the memory is the
        same (``is_pinned()`` holds where the buffer is pinned; with masters on disk the mapped
        file's pages are the parameters'), and the footprint counts the flat buffer. Each storage
        keeps the flat buffer alive, so a parameter kept after its model is dropped keeps its
        values. Code that follows memory by storage must compare addresses instead: the
        stream-ordering checker does (``offload/streamcheck/memory.py``).

    Args:
        layers: the slice's layers.
        allocate: host byte allocator for buffers on ``offload_device``: pinned memory when
            copies are asynchronous (see ``CopyStreams.empty_host``).
        compute_dtype: dtype of the device copies of floating-point parameters (outside
            batch and instance norms); ``None`` keeps every dtype. When set, a pinned *shadow*
            holds the slice in the device layout and dtypes, so loads move half the bytes of float32; it is
            refreshed from the host copies once per forward (see :meth:`transfer_source`).
        held_elsewhere: ids of the tensors earlier slices hold; such parameters are borrowed.
        allocate_masters: makes the host buffer of a slice that has a shadow as a file mapping
            (:class:`~offload.streams.mapped.MappedFile`, Note: [Masters on disk]); ``None`` keeps
            it in RAM from ``allocate``. A slice without a shadow keeps it in RAM either way: its
            loads read it.
        gradient_home: makes the file that holds the slice's gradients beside masters on disk
            (Note: [Gradients on disk] in ``gradient_files.py``), given its parameters.
        staged: with masters on disk, keep no shadow: each load casts the masters into a staging
            buffer (Note: [Shadows on disk] in ``shadow_staging.py``).

    Raises:
        ValueError: for sparse tensors, a tensor registered both as parameter and as buffer, a
            buffer that an earlier slice holds, a tensor on the meta device outside
            :func:`filled_by_caller`, tensors over one memory (:func:`check_memory_held_once`), a
            batch or instance norm in neither float32 nor the compute dtype, or a parameter narrower
            than the compute dtype (a float16 one under bfloat16; :func:`_set_device_dtypes`).
    """

    resident = False  #: whether the slice stays on the device (``resident_storage.py``)
    #: each substitute with its host copy (Note: [Tensors substituted for a call])
    substitutes: Sequence[tuple[Entry, torch.Tensor]] = ()
    #: the file that holds the slice's gradients, with its masters on disk (set by :meth:`build`)
    gradient_home: GradientHome | None = None
    #: whether a build collected the slice's entries: the first one is the wrap's (:func:`_set_device_dtypes`)
    collected = False
    #: the last write-back of its masters on disk that failed (:meth:`release_masters`)
    unwritten: Unwritten | None = None

    def __init__(self, layers: Sequence[nn.Module], allocate: Callable[[int], torch.Tensor],
                 compute_dtype: torch.dtype | None = None, held_elsewhere: Collection[int] = (),
                 allocate_masters: Callable[[int], MappedFile] | None = None,
                 gradient_home: Callable[[list[Entry]], GradientHome | None] | None = None,
                 staged: bool = False) -> None:
        self.layers = list(layers)
        self.stages_shadow = staged
        self.allocate = allocate
        self.allocate_masters = allocate_masters
        self.make_gradient_home = gradient_home
        self.compute_dtype = compute_dtype
        self.held_elsewhere = frozenset(held_elsewhere)
        self.build()

    def build(self) -> None:
        """Lay the slice out and move every tensor's data (but borrowed parameters' and
        substitutes') into the flat buffer.

        One that raises (no room for masters on disk, an interrupt) gives each tensor it moved memory
        of its own (``take_in.give_back``): :meth:`moved` then says so, and the next refresh lays it out again.
        """
        self._built = False
        self._collect()
        self._lay_out()
        outside = [entry for entry in self.held if entry.sites and views_outside(entry.tensor)]  # before they move
        with given_back_if_raising(self):  # Note: [A build that raises] in ``take_in.py``
            self._move_in()
        #: what the layout took out of memory another tensor holds (Note: [Tensors that view another's memory])
        self.viewed_outside = [e for e in outside if not any(e is kept for kept, _ in self.substitutes)]
        self._built = True

    def _collect(self) -> None:
        """The slice's entries: its parameters (its own, then those borrowed from an earlier
        slice) and buffers, and the dtype of each one's device copy."""
        check_memory_held_once(self.layers)  # before anything changes
        params, self.buffers = collect_entries(self.layers)
        self._registered = RegisteredTensors(self.layers)
        _check_buffers_held_once(self.buffers, self.held_elsewhere, self.layers)
        for entry in params:
            entry.borrowed = id(entry.tensor) in self.held_elsewhere
        own = [e for e in params if not e.borrowed]
        self.borrowed = [e for e in params if e.borrowed]
        self.companions = companions_of(own, self.borrowed, self.held_elsewhere)  # Note: [Quantized weights]
        self.params = own + self.borrowed
        self.entries = self.params + self.companions + self.buffers
        self.run_state_positions = run_state_positions(self.params)  # Note: [Quantized weights], rule 6
        #: what this slice holds: laid out in the host buffer, in the same order as in the slot
        self.held = own + self.companions + self.buffers
        self._running_stat_modules = _running_stat_modules(self.layers)
        _set_device_dtypes(self.params, self.layers, self.compute_dtype, wrapping=not self.collected)
        self.collected = True

    def _lay_out(self) -> None:
        """Each held entry's offset in the host buffer and in the device slot (borrowed parameters
        after the loaded bytes in the slot: :func:`lay_out`), and the sizes and regions that follow."""
        layout = lay_out(self.held, self.buffers, self.borrowed)
        self.cast_runs = _runs(self.held)
        self.host_buffer_region, self.buffer_region = layout.host_buffer_region, layout.buffer_region
        #: bytes a load copies from :meth:`transfer_source`; borrowed parameters follow them in the slot
        self.load_nbytes = layout.load_nbytes
        self.device_nbytes, self.host_nbytes = layout.device_nbytes, layout.host_nbytes

    def _move_in(self) -> None:
        """Allocate the host buffer (or map the masters' file) and move every held tensor's data
        into it, each under a storage of its own; allocate the shadow when a load casts."""
        casts = any(entry.device_dtype != entry.dtype for entry in self.held)
        #: the file mapping that holds the host buffer, when the masters are on disk
        self.masters_file = self.allocate_masters(self.host_nbytes) if casts and self.allocate_masters else None
        self.flat = self.masters_file.tensor[:self.host_nbytes] if self.masters_file is not None else self.allocate(self.host_nbytes)
        self.substitutes = take_in(self.held, self.flat)
        settle_8bit_layers(self.params)  # Note: [Quantized weights], rule 6
        self._expected_ptrs = [entry.tensor.data_ptr() for entry in self.entries]
        self.release_masters()  # what was copied in goes to disk
        self.gradient_home = (self.make_gradient_home(self.params) if self.masters_file is not None
                              and self.make_gradient_home is not None else None)
        #: whether loads cast the masters on disk into a staging buffer (Note: [Shadows on disk])
        self.staged = casts and self.masters_file is not None and self.stages_shadow
        self.shadow = self.allocate(self.load_nbytes) if casts and not self.staged else None
        self.staged_source: torch.Tensor | None = None  #: the buffer the next load copies (ShadowStaging.stage)
        self._held_by_id = {id(entry.tensor): entry for entry in self.held}
        self._shadow_current = False
        self.shadow_refreshes = 0
        # Ready event of the last load that read the shadow: a refresh must wait for it.
        self.shadow_read: Event | None = None

    def shadow_stale(self) -> bool:
        """Whether the shadow must be refreshed (or, :attr:`staged`, staged) before the next load."""
        return self.staged or (self.shadow is not None and not self._shadow_current)

    def refresh_shadow(self, staging: torch.Tensor | None = None) -> None:
        """Cast the host copies into the shadow, or (:attr:`staged`) the buffer ``staging`` the next load
        copies, which no load still reads; masters on disk are read in first and dropped after.

        Raises:
            DiskTierError: masters on disk could not be read, or written back (:meth:`release_masters`).
        """
        if self.masters_file is not None:
            read_masters_in(self.masters_file)
        self.write_shadow(into=None if staging is None else staging[:self.load_nbytes])
        self._shadow_current = staging is None
        self.shadow_refreshes += 1
        self.release_masters()

    def release_masters(self) -> None:
        """Write masters on disk back and take them out of RAM (nothing when they are in RAM).

        Raises:
            DiskTierError: they could not be written; :attr:`unwritten` records it, for the model's
                OffloadOptimizer to refuse saves (Note: [A write-back outside the masters' writer]
                in ``masters_io.py``).
        """
        if self.masters_file is not None:
            write_masters_back(self)

    def write_shadow(self, written: Collection[int] = (), into: torch.Tensor | None = None) -> None:
        """Cast what the slice holds into the shadow (or ``into``), but for the host copies at the
        addresses ``written`` (whose shadow the one-pass update wrote)."""
        _cast_into(self.shadow if into is None else into, self.flat, self.held, self.cast_runs, written)

    def shadow_written(self) -> None:
        """The shadow was written from the current host copies (by a host update)."""
        self._shadow_current = True
        self.shadow_refreshes += 1

    def transfer_source(self) -> torch.Tensor:
        """The bytes a load copies to a slot: the host buffer, the shadow, or the staging buffer written last."""
        if self.staged:
            return self.staged_source if self.staged_source is not None else self.flat[:0]
        return self.flat if self.shadow is None else self.shadow

    def holds(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._held_by_id

    def transfer_source_of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """The bytes a load of a parameter this slice holds copies, from the host buffer or the
        shadow, and their dtype (for a slice that borrows it)."""
        entry = self._held_by_id[id(tensor)]
        nbytes = entry.shape.numel() * _itemsize(entry.device_dtype)
        offset = entry.host_offset if self.shadow is None and not self.staged else entry.device_offset
        return self.transfer_source()[offset:offset + nbytes], entry.device_dtype

    def expire_shadow(self) -> None:
        """The host copies may have changed (a new forward): refresh the shadow before the next load."""
        self._shadow_current = False

    def moved(self) -> bool:
        """Whether a tensor's ``.data`` was replaced since :meth:`build` (``p.data = other``).

        Replacing ``.data`` takes the tensor out of the flat buffer, so the next load would miss the
        new values; the caller rebuilds the storage when this is true. Also true after a
        :meth:`build` that raised. Pointers only: a substitute's values are :func:`substitutes_changed`'s.
        """
        if not self._built:
            return True
        for entry, ptr in zip(self.entries, self._expected_ptrs):
            tensor = entry.tensor
            if tensor.data_ptr() != ptr or tensor.dtype != entry.dtype or tensor.shape != entry.shape:
                return True
        return False

    def registered_tensors_changed(self) -> bool:
        """Whether the layers now register other tensors than the ones laid out: a site that holds
        another tensor (``layer.weight = nn.Parameter(...)``), or modules, parameters or buffers
        added or removed through ``setattr`` or ``register_*`` (adapters injected into the
        layers, ``peft.get_peft_model`` say), or a 4-bit weight's quantisation state replaced."""
        return self._registered.changed(self.entries) or states_replaced(self.params)

    def param_versions(self) -> tuple[int, ...]:
        """In-place modification counters of the parameters (the optimizer bumps them)."""
        return tuple(entry.tensor._version for entry in self.params)

    def buffer_bytes(self) -> torch.Tensor:
        """The host buffer's byte region that holds the buffers (same layout as on the device:
        buffers keep their dtype)."""
        start, end = self.host_buffer_region
        return self.flat[start:end]

    def device_views(self, slot: torch.Tensor) -> list[torch.Tensor]:
        """Every entry's device copy in a slot that holds this slice, each with its own version counter."""
        return [alias(slot, e.device_offset, e.device_dtype, e.shape, e.stride) for e in self.entries]

    def has_running_stats_in_training(self) -> bool:
        """Whether a normalisation layer here updates running statistics in this forward.

        Their kernels update ``running_mean``/``running_var`` without bumping the tensors' version
        counters, so a version check alone would not see the change.
        """
        return any(module.training for module in self._running_stat_modules)


def shadow_views(storage: SliceStorage) -> dict[int, torch.Tensor]:
    """The shadow of each host copy of ``storage`` that is cast (a float32 one, row-major), by the
    host copy's address: where the one-pass update writes it (Note: [One-pass update] in
    ``offload/kernels/one_pass.py``)."""
    assert storage.shadow is not None
    base = storage.flat.data_ptr()
    return {base + entry.host_offset: typed_view(storage.shadow, entry.device_offset, entry.device_dtype,
                                                 torch.Size([entry.shape.numel()]))
            for entry in storage.held
            if entry.dtype == torch.float32 and entry.device_dtype in (torch.bfloat16, torch.float16)
            and entry.stride is None}


def _cast_into(shadow: torch.Tensor, flat: torch.Tensor, held: Sequence[Entry], runs: Sequence[range],
               written: Collection[int]) -> None:
    """Cast the host copies ``held`` (in ``flat``) into ``shadow``, a run of equal dtypes at a time,
    but for those at the addresses ``written``."""
    with torch.no_grad():
        for run in runs:
            for start, stop in _unwritten(held, run, flat.data_ptr(), written):
                begin, end = held[start], held[stop - 1]
                count = (end.host_offset - begin.host_offset) // _itemsize(begin.dtype) + end.shape.numel()
                source = typed_view(flat, begin.host_offset, begin.dtype, torch.Size([count]))
                typed_view(shadow, begin.device_offset, begin.device_dtype, torch.Size([count])).copy_(source)


def _unwritten(held: Sequence[Entry], run: range, base: int, written: Collection[int]) -> Iterator[tuple[int, int]]:
    """The stretches ``(start, stop)`` of ``run`` whose host copies (at ``base`` + their offset) are
    not among the addresses ``written``."""
    start = None
    for k in run:
        if base + held[k].host_offset in written:
            if start is not None:
                yield start, k
            start = None
        elif start is None:
            start = k
    if start is not None:
        yield start, run.stop
