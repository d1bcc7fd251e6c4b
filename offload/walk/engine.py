"""The slices of one model and the machinery that moves them: what a forward or backward walk uses.

An :class:`Engine` is built once per :class:`~offload.OffloadModel`. It holds no per-call state:
everything a backward needs from its forward travels in the autograd context, so several forwards
may be in flight before their backwards.
"""

from __future__ import annotations

import functools
import operator
import threading
import types
import warnings
import weakref
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils.parametrize import ParametrizationList

from .binding import Binding, BufferMovedError, BufferPlaces, BufferWatch, give_back_unheld
from .claims import WalkClaim
from ..tiers.master_files import place_masters
from .milestones import Milestones
from .structures import map_tensors
from ..streams import (ActivationOffloader, CopyStreams, DeviceSlots, Entry, GradientOffloader, HostBufferPool,
                       SliceStorage, SliceUpdates, holder_of)
from ..streams.host_storage import _same_bits as same_bits, substitutes_changed
from ..streams.pinned import size_class
from ..streams.slice_entries import bind_device_weights
from ..streams.resident_storage import ResidentStorage
from ..streams.shadow_staging import ShadowStaging
from ..streams.take_in import given_back_on_failure


# What AOTAutograd says of a layer it compiled that writes in place into tensors sharing a storage.
_COMPILED_BUFFER_WRITE = "input mutations"
COMPILED_BUFFER_NOTE = (
    "OffloadModel: torch.compile cannot compile a layer that writes a buffer in forward (BatchNorm's running "
    "statistics in training) inside OffloadModel: a slice's tensors lie in one device allocation, which it refuses "
    "for tensors written in place. Leave this layer uncompiled (docs/api.md, Limitations).")
# What torch.func says of a gradient transform run under saved-tensor hooks.
_FUNC_TRANSFORM_HOOKS = "don't yet support saved tensor hooks"
FUNC_TRANSFORM_NOTE = (
    "OffloadModel: while it builds a graph, OffloadModel runs every layer under saved-tensor hooks (they keep, "
    "offload or drop what autograd saves), and torch.func.grad, vjp, jacrev and hessian refuse to run under them. "
    "Compute the gradient with torch.autograd.grad inside the layer instead (create_graph=True if backward must go "
    "through it) and pass checkpoint_activation=False, leaving the layer's slice out of offload_activations "
    "(docs/api.md, Layers that differentiate in forward). Under torch.no_grad the layer runs as it is.")


#: A module's ``training`` flag, read without a Python frame per module.
_TRAINING = operator.attrgetter("training")


class BufferModes:
    """What the probes found of a slice's runs, per mode: whether they change a buffer unseen
    (rule 1 of Note: [Buffers] in ``offload/walk/slice_walk.py``).

    A mode is grad mode and the ``training`` flag of each module that holds a buffer or holds a
    module that does: the flags that decide whether a layer updates its buffers (its own or its
    children's). ``.train()``/``.eval()`` makes another mode, and so does one layer switched alone.
    Only those modules, so that the flags read at every run of the slice are few.

    Args:
        storage: the slice's storage, as laid out now: a new layout needs new ``BufferModes`` (the
            modules, and which of them holds which buffer, may have changed).
    """

    def __init__(self, storage: SliceStorage) -> None:
        self._buffers = storage.buffers  # a new layout collects a new list
        self._modules = [m for layer in storage.layers for m in layer.modules() if next(m.buffers(), None) is not None]
        self.places = BufferPlaces(storage.layers, storage.buffers)  # which layer holds which: rule 5
        #: per mode a run was probed in: whether the run changed a buffer without moving its counter
        self.written_unseen: dict[tuple[bool, ...], bool] = {}

    def describes(self, storage: SliceStorage) -> bool:
        """Whether these modes are of ``storage``'s layout as it is now."""
        return self._buffers is storage.buffers

    def before_run(self, slots: DeviceSlots, index: int, storage: SliceStorage) -> BufferProbe:
        """The look of a run of slice ``index`` that starts now (it must be acquired): a copy of
        its buffers' bytes where a run in its mode was never probed. Normalisation layers that
        update running statistics make every run in their mode count as changed: no copy there."""
        mode = (torch.is_grad_enabled(), *map(_TRAINING, self._modules))
        if mode in self.written_unseen or storage.has_running_stats_in_training():
            return BufferProbe(self, mode, None)
        with torch.no_grad():
            return BufferProbe(self, mode, slots.buffers.snapshot(index))


@dataclass
class BufferProbe:
    """One run's look at its slice's buffers (rule 1 of Note: [Buffers]).

    Attributes:
        modes: the slice's modes.
        mode: the one the run happens in.
        before: the buffers' bytes before the run, where that mode was never probed; else None.
    """

    modes: BufferModes
    mode: tuple[bool, ...]
    before: torch.Tensor | None

    def written_unseen(self, slots: DeviceSlots, index: int, storage: SliceStorage,
                       tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> bool:
        """Whether the run, just done, counts as changing a buffer unseen: as the probe of its mode
        found, compared now (and remembered) where this run is that probe."""
        if self.before is None:
            return self.modes.written_unseen.get(self.mode, False)
        # A buffer whose counter moved was changed in sight (the rule counts it anyway): compare the others.
        first = len(storage.entries) - len(storage.buffers)
        unmoved = [entry for entry, tensor, version in zip(storage.buffers, tensors[first:], versions[first:])
                   if tensor._version == version]
        with torch.no_grad():
            written = slots.buffers.changed_since(index, self.before, unmoved)
        self.modes.written_unseen[self.mode] = written
        return written


@dataclass
class Slice:
    """A contiguous run of layers that is loaded and run as a unit."""

    index: int
    names: list[str]
    layers: list[nn.Module]
    storage: SliceStorage
    buffer_modes: BufferModes | None = None  # made at the first run with buffers, and anew for a new layout

    def run(self, inputs: Any, buffers: BufferWatch | None = None) -> Any:
        # nn.Sequential semantics: each layer gets the previous layer's output as its one argument.
        for position, (name, layer) in enumerate(zip(self.names, self.layers)):
            try:
                inputs = layer(inputs)
                if buffers is not None:  # before the next layer reads what a grown buffer overwrote
                    buffers.refuse_moved(position)
            except Exception as error:
                # A note says where (PEP 678); the exception itself, type included, is the layer's.
                note = f"in layer {name} ({type(layer).__name__}) of OffloadModel slice {self.index}"
                if note not in getattr(error, "__notes__", ()):
                    error.add_note(note)
                    if _COMPILED_BUFFER_WRITE in str(error):
                        error.add_note(COMPILED_BUFFER_NOTE)
                    if _FUNC_TRANSFORM_HOOKS in str(error):
                        error.add_note(FUNC_TRANSFORM_NOTE)
                raise
        return inputs

    def modules(self) -> list[nn.Module]:
        """Every module of the slice's layers, submodules included."""
        return [module for layer in self.layers for module in layer.modules()]

    def entry_tensors(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What the layers run with, one per storage entry: each parameter's device copy as an
        ``nn.Parameter``, a leaf that requires grad as the host copy does (also where no graph is
        built: kernels that read the flag, ``torch.matmul`` folding a non-contiguous input into one
        product, then choose as in the plain model, whose parameters keep it under ``no_grad``),
        each buffer's as it is.

        Parameters, as in the plain model: a layer that takes its weight out of ``_parameters`` and
        puts it back during forward (``register_parametrization`` / ``remove_parametrizations``, as
        PEFT's LoRA on fused experts does) registers it again as a parameter, not as a buffer, and
        code that checks ``isinstance(w, nn.Parameter)`` sees what it sees there.
        """
        # A parameter's version counter is its own (``.data``), not the slot's: a write to it in
        # forward is told apart from a buffer's (Note: [Parameters written in forward]).
        tensors = [
            nn.Parameter(view.data, requires_grad=entry.tensor.requires_grad) if entry.is_parameter
            else view
            for view, entry in zip(views, self.storage.entries)
        ]
        if self.storage.companions:  # Note: [Quantized weights] in offload/streams/quantized.py
            bind_device_weights(tensors, views, self.storage.params)
        return tensors

    def bound(self, tensors: Sequence[torch.Tensor]) -> Binding:
        """A context in which the layers see ``tensors`` (one per storage entry) in place of their
        host copies (see Note: [Device copies while autograd runs a slice] in
        ``offload/autograd/slice_graph.py``)."""
        return Binding([entry.sites for entry in self.storage.entries], tensors, self.storage.run_state_positions)

    def run_on_device(self, slots: DeviceSlots, tensors: Sequence[torch.Tensor], inputs: Any) -> SliceResult:
        """Run the layers on ``inputs`` with ``tensors`` (one per storage entry, views of the
        slice's slot or leaves over them) in place of the host copies. The slice must be acquired.
        """
        has_buffers = bool(self.storage.buffers)
        written_before = slots.buffers.write_counter(self.index) if has_buffers else 0
        versions = [t._version for t in tensors]
        probe = self._probe_buffers(slots) if has_buffers else None
        watch = probe.modes.places.watch(tensors, self.site_name, self.index) if probe is not None else None
        sites = [entry.sites for entry in self.storage.entries]
        binding = Binding(sites, tensors, self.storage.run_state_positions)
        check = functools.partial(_check_reassigned, self.index, compute_dtype=self.storage.compute_dtype)
        try:
            with binding:
                output = self.run(inputs, watch)
            if watch is not None:
                watch.refuse_moved()  # rule 5 of Note: [Buffers]: also one layer's write to another's buffer
        except BufferMovedError:
            watch.put_back(self.storage.device_views(slots.slot_of(self.index).data))  # type: ignore[union-attr]
            raise
        except Exception:  # the failure path writes the buffers back (Note: [The walk]): keep the assignments
            binding.keep_reassigned(check, refuse=False)
            raise
        self._refuse_parameter_writes(tensors, versions)
        # An output that aliases the slot (a layer returning a weight or a view of one) would change
        # under the caller's feet when the slot is reused: give it memory of its own (in a dataclass too).
        output = map_tensors(lambda t: t.clone() if slots.owns(t) else t, output, f"slice {self.index}'s output")
        binding.keep_reassigned(check)
        # Rule 1 of Note: [Buffers] in offload/walk/slice_walk.py; the probe first, so that what it
        # finds is remembered whatever the other tests say.
        changed = probe is not None and (
            probe.written_unseen(slots, self.index, self.storage, tensors, versions)
            or bool(binding.reassigned)
            or slots.buffers.write_counter(self.index) != written_before
            or self.storage.has_running_stats_in_training()
        )
        return SliceResult(output, changed)

    def _probe_buffers(self, slots: DeviceSlots) -> BufferProbe:
        """This run's look at the buffers (rule 1 of Note: [Buffers])."""
        if self.buffer_modes is None or not self.buffer_modes.describes(self.storage):
            self.buffer_modes = BufferModes(self.storage)
        return self.buffer_modes.before_run(slots, self.index, self.storage)

    def _refuse_parameter_writes(self, tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
        """Raise if the run wrote a parameter's device copy in place (Note: [Parameters written in forward])."""
        for tensor, version, entry in zip(tensors, versions, self.storage.entries):
            if tensor._version == version or not entry.is_parameter:
                continue
            if any(isinstance(site.module, ParametrizationList) for site in entry.sites):
                continue  # rule 2: set_() to itself, as register_parametrization does on every call
            if not _as_host_copy(tensor, entry.tensor):  # rule 3: a move that changed nothing is let through
                raise RuntimeError(
                    f"OffloadModel: {self.site_name(entry.sites[0])} was changed in place during forward, in slice "
                    f"{self.index}. OffloadModel runs layers on a device copy of each parameter and writes only buffers "
                    "back, so the parameter would keep its old value and every later output and gradient would differ "
                    "from the plain model's; the parameter was left unchanged. nn.Embedding(max_norm=...) is the usual "
                    "cause (it renormalises the rows it looks up in place, in forward); a forward (pre-)hook that "
                    "constrains a weight in place is another. Make the change outside forward, on the parameter "
                    "itself under torch.no_grad(): after optimizer.step(), say, or for an Embedding set max_norm=None "
                    "and call torch.embedding_renorm_(layer.weight, ids, max_norm, norm_type) on the batch's ids "
                    "before calling the model (docs/api.md, Limitations).")

    def site_name(self, site: Any) -> str:
        """``site``'s parameter or buffer by its name in the model, and its module's type, for messages."""
        kind = "parameter" if site.is_parameter else "buffer"
        for name, layer in zip(self.names, self.layers):
            for sub_name, module in layer.named_modules():
                if module is site.module:
                    owner = f"{name}.{sub_name}" if sub_name else name
                    return f"{kind} '{owner}.{site.name}' ({type(module).__name__})"
        return f"{kind} '{site.name}' of a {type(site.module).__name__}"


def _as_host_copy(device_copy: torch.Tensor, host_copy: torch.Tensor) -> bool:
    """Whether a parameter's device copy still holds what its load copied from the host copy (as a
    cast to the device copy's dtype gives it); ``False`` where that cannot be told."""
    if device_copy.data_ptr() == host_copy.data_ptr() or device_copy.shape != host_copy.shape:
        return False  # a resident slice's parameter is its device copy: nothing to compare with
    try:
        # Bit for bit: a NaN equals itself (a weight that holds one is not taken as written), and
        # -0.0 written over 0.0 is a write.
        return same_bits(device_copy, host_copy.detach().to(device_copy.device, device_copy.dtype))
    except (RuntimeError, TypeError):  # a quantised weight's codes, say
        return False


@dataclass
class SliceResult:
    """What running a slice on one microbatch produced.

    Attributes:
        output: the slice's output.
        buffers_changed: the run changed the slice's buffers on the device (rule 1 of Note:
            [Buffers] in ``offload/walk/slice_walk.py``).
    """

    output: Any
    buffers_changed: bool


class Engine:
    """Slices, their host storage, device slots and copy streams of one model.

    Args:
        groups: the layers of each slice, with their names.
        device: the compute device.
        host_device: where host copies live (``offload_device``).
        compute_dtype: dtype of the device copies of floating-point parameters, or None.
        masters: where the float32 masters live: ``None`` (RAM), or a :class:`~offload.DiskTier`
            or directory (Note: [Masters on disk] in ``offload/tiers/master_files.py``).
        resident_slices: how many of the first slices stay on the device (Note: [Resident slices]
            in ``offload/streams/resident_storage.py``).
        shadows: ``"ram"``, or ``"disk"`` to keep no shadow per slice with the masters on disk
            (Note: [Shadows on disk] in ``offload/streams/shadow_staging.py``).
    """

    walk_running: Any = None  #: the SliceWalk ``walking``'s thread runs now, if any: a WalkClaim sets it
    claimed_at: types.FrameType | None = None  #: the frame holding ``walking``'s claim: a WalkClaim sets it

    def __init__(self, groups: Sequence[tuple[list[str], list[nn.Module]]], device: torch.device,
                 host_device: torch.device, compute_dtype: torch.dtype | None = None, masters: Any = None,
                 resident_slices: int = 0, shadows: str = "ram") -> None:
        self.device = device
        self.num_resident = resident_slices
        self.copies = CopyStreams(device)
        #: the masters' files, or None when they are in RAM
        self.master_files = place_masters(masters, compute_dtype, self.copies)
        allocate_masters = self.master_files.allocate if self.master_files is not None else None
        # Optimizers' disk tiers over this model's slices: memory_footprint() counts their bytes.
        self.disk_tiers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.pin = self.copies.pins_host_memory and host_device.type == "cpu"
        # Bound to the copy streams: held by the pool, storages and staging, a closure over the engine
        # would make a cycle, and a dropped model's buffers would wait for the cycle collector.
        allocate = functools.partial(self.copies.empty_host, host_device=host_device)
        # Pinned buffers come in size classes: registering one costs driver and system calls.
        self.pool = HostBufferPool(allocate, size_class if self.pin else None)
        self._allocate = allocate
        self.staging: ShadowStaging | None = None  # set by _build_device_side
        #: the OffloadOptimizers stepping this model, for its memory footprint
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.milestones = Milestones()
        #: the thread whose forward or backward holds the engine now, if any (Note: [One walk at a
        #: time] in offload/walk/slice_walk.py: only a ``WalkClaim`` sets it)
        self.walking: threading.Thread | None = None
        self.activations = ActivationOffloader(self.copies, self.pool)
        # - What is known of the parameters, by id: an id stays one parameter's while the slices
        #   hold it, so no weak reference to a parameter is needed (one would stop
        #   torch.utils.swap_tensors, which load_state_dict and .to() use under
        #   torch.__future__.set_swap_module_params_on_conversion)
        self.parameter_ids: frozenset[int] = frozenset()
        #: whether each parameter was seen to receive gradients from the model only (Note: [Adding
        #: onto earlier gradients] in offload/autograd/outside_gradients.py)
        self.known_sources: dict[int, bool] = {}
        #: the ``.grad`` each parameter had when it was zeroed in place, as (id, address, version)
        #: (Note: [Gradients added in place] in offload/autograd/accumulation.py)
        self.zeroed_gradients: dict[int, tuple[int, int, int]] = {}
        # - Said once per model (Note: [Tensors that view another's memory] in offload/streams/host_storage.py)
        self.warned_viewed_outside = False
        self.slices: list[Slice] = []
        with given_back_on_failure(self.slices):  # Note: [A build that raises] in offload/streams/take_in.py
            held: set[int] = set()  # what earlier slices hold (Note: [Tied parameters across slices])
            _before_layout(None, [layer for _, layers in groups for layer in layers])
            for i, (names, layers) in enumerate(groups):
                homes = (functools.partial(self.master_files.gradient_home, i) if self.master_files is not None
                         else None)  # Note: [Gradients on disk]
                storage = (ResidentStorage(layers, device, compute_dtype, held) if i < resident_slices
                           else SliceStorage(layers, allocate, compute_dtype, held, allocate_masters, homes,
                                             staged=shadows == "disk"))
                self.slices.append(Slice(i, names, layers, storage))
                held.update(id(e.tensor) for e in storage.held)
            _check_borrowed(self.slices)
            self.warn_viewed_outside()
            self._build_device_side()
        _LIVE.add(self)

    def _build_device_side(self) -> None:
        storages = [s.storage for s in self.slices]
        # A parameter that left the slices may be gone, and its id another's: forget it.
        self.parameter_ids = frozenset(id(p) for p in self.parameters())
        self.known_sources = {k: v for k, v in self.known_sources.items() if k in self.parameter_ids}
        self.zeroed_gradients = {k: v for k, v in self.zeroed_gradients.items() if k in self.parameter_ids}
        # What the resident slices hold, by id, for stays_on_device (each backward asks, per slice).
        self._on_device = {id(e.tensor) for st in storages if st.resident for e in st.held}
        needed = max(st.device_nbytes for st in storages)
        slots = getattr(self, "slots", None)
        if slots is not None:
            self.updates.adopt(storages)
        else:
            self.updates = SliceUpdates(self.copies, storages)
        self._size_staging(storages)
        if slots is not None and slots.slot_nbytes >= needed:
            # Keep the slots object: graphs still waiting for backward resolve their slot
            # references through it.
            slots.adopt(storages)
            slots.staging = self.staging
        else:
            self.slots = DeviceSlots(storages, self.copies, self.updates, pool=self.pool, staging=self.staging)
        self.gradients = GradientOffloader(self.copies, self.pool)

    def _size_staging(self, storages: Sequence[Any]) -> None:
        """The staging window for the slices that stage their loads, as large as the largest one's
        (Note: [Shadows on disk]); none when no slice stages."""
        needed = max((st.load_nbytes for st in storages if getattr(st, "staged", False)), default=0)
        if self.staging is None or self.staging.buffer_nbytes < needed or not needed:
            # Between walks (refresh runs before a forward): no load reads the old buffers.
            self.staging = ShadowStaging(self._allocate, needed)

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    def traffic(self) -> tuple[int, int]:
        """Bytes loaded (host to device) and offloaded (device to host) since the model was built."""
        return self.copies.loaded_bytes, self.copies.offloaded_bytes

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter, slice by slice, in the order the autograd Function receives them."""
        return [entry.tensor for s in self.slices for entry in s.storage.params]  # type: ignore[misc]

    def stays_on_device(self, entries: Sequence[Entry]) -> list[bool]:
        """Per entry, whether its tensor lives on the device: a resident slice holds it (Note:
        [Resident slices]), so its gradient stays there too."""
        return [id(entry.tensor) in self._on_device for entry in entries]

    def tied_parameter_ids(self) -> set[int]:
        """The parameters that more than one slice computes with (a weight tied across slices), by id."""
        seen: set[int] = set()
        tied: set[int] = set()
        for p in self.parameters():
            (tied if id(p) in seen else seen).add(id(p))
        return tied

    def parameter_names(self) -> dict[int, str]:
        """Each parameter's name for messages ("'weight' of a Linear in slice 3"), by id."""
        names: dict[int, str] = {}
        for s in self.slices:
            for entry in s.storage.params:
                site = entry.sites[0]
                names.setdefault(id(entry.tensor), f"'{site.name}' of a {type(site.module).__name__} in slice {s.index}")
        return names

    def release_masters(self, index: int | None = None) -> None:
        """Write masters on disk back and take them out of RAM: slice ``index``'s, or every slice's
        (a checkpoint reads or writes them; Note: [Masters on disk])."""
        for s in self.slices if index is None else [self.slices[index]]:
            s.storage.release_masters()

    def refresh(self) -> None:
        """Follow changes the user made to parameters since the last call.

        ``p.data = other`` or assigning a new ``nn.Parameter`` to a layer takes the tensor out of the
        slice's flat host buffer; the slice is laid out again so the next load sees the change.

        Raises:
            RuntimeError: another thread walks the slices now; its layers hold device copies, which
                would be taken for changes (Note: [One walk at a time] in ``slice_walk.py``).
        """
        with WalkClaim(self, "a forward (or a move, .to())"):
            # Before the layers' registrations are read: an interrupt that landed as a run's binding
            # was given back leaves device copies in them (Note: [Interrupts while binding], rule 4).
            give_back_unheld()
            self._follow_changes()

    def _follow_changes(self) -> None:
        """:meth:`refresh` under its claim."""
        # Before anything reads or lays out a parameter another model holds too: its optimizer may
        # still be writing it (Note: [Parameters several models hold]).
        settle_other_holders(self, self.parameter_ids)
        # The cheap checks first; a substitute's values are compared once a refresh, and only where
        # nothing else lays its slice out again (Note: [Tensors substituted for a call]).
        changed = {s.index for s in self.slices if s.storage.registered_tensors_changed() or s.storage.moved()
                   or substitutes_changed(s.storage)}
        if not changed:
            return  # the common case, checked every forward
        _before_layout(self, [layer for s in self.slices for layer in s.layers])  # before anything moves
        # A change made through a reference taken before step(): the pending updates still write
        # the host copies being laid out again, which copies what they hold.
        self.updates.wait_all(shadows_stale=True)
        held: set[int] = set()
        for s in self.slices:
            # Earlier slices first: what a slice borrows depends on what they hold now (and where).
            if s.index in changed or s.storage.moved() or held != s.storage.held_elsewhere:
                s.storage.held_elsewhere = frozenset(held)
                s.storage.build()
            held.update(id(e.tensor) for e in s.storage.held)
        _check_borrowed(self.slices)
        self.warn_viewed_outside()
        self._build_device_side()

    def warn_viewed_outside(self) -> None:
        """Warn, once for this model, that a layout took in a tensor that viewed memory another
        tensor holds (Note: [Tensors that view another's memory] in ``offload/streams/host_storage.py``)."""
        found = [(s, entry) for s in self.slices for entry in s.storage.viewed_outside]
        if self.warned_viewed_outside or not found:
            return
        self.warned_viewed_outside = True
        first, entry = found[0]
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        warnings.warn(
            f"OffloadModel: {first.site_name(entry.sites[0])}{more} viewed memory that another tensor holds "
            "(p.data = flat[a:b].view_as(p), torch.nn.utils.vector_to_parameters, a view passed to "
            "torch.func.functional_call). OffloadModel keeps every parameter and buffer in a host buffer of its own, "
            "so it copied the values there: later in-place changes to the tensor it viewed will not reach the model, "
            "as they would in plain PyTorch (an optimizer stepping a flat buffer no longer trains it). Change the "
            "parameters themselves: build the optimizer over model.parameters() (docs/memory.md, Parameters that "
            "view another tensor).", stacklevel=3)


#: Every engine alive (weakly: models may be dropped).
_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()


def live_engines() -> list[Engine]:
    """Every engine alive now, held strongly while the caller reads them."""
    return list(_LIVE)


def engines_holding(p: torch.Tensor) -> list[Engine]:
    """The engines whose slices hold ``p`` (as of their last layout): usually one, or none."""
    return [engine for engine in live_engines() if id(p) in engine.parameter_ids]


def held_by_an_engine(p: torch.Tensor) -> bool:
    """Whether an OffloadModel's slices hold ``p`` (as of their last layout)."""
    return any(id(p) in engine.parameter_ids for engine in live_engines())


def settle_other_holders(engine: Engine | None, ids: Collection[int]) -> None:
    """Block until the pending updates of every live engine but ``engine`` that holds one of the
    parameters ``ids`` are done, leaving them pending there (with the shadows they wrote).

    Note: [Parameters several models hold]
        Several OffloadModels may hold one parameter: a submodule two nn.Sequentials share, one
        nn.Sequential wrapped twice, an OffloadModel used as a layer of another, one Hugging Face
        model in two OffloadedCausalLMs. Each lays it out in a host buffer of its own, so a layout
        by one takes it out of the other's (``moved()``), which lays it out again at its next
        forward: both compute with its current values, as in plain PyTorch. But an
        OffloadOptimizer's update of it may still be pending on the other model's worker, writing
        the memory it was handed (an update follows the parameter's memory only when it is handed
        over: ``SliceStep.bind``). A layout that copied the parameter before that update landed
        would lose it for good; a load would read it half written. So an engine waits for every
        other holder's pending updates before it lays out or reads anything: at each refresh (every
        forward) and when it is built. Every update then lands where the parameter's data is, and
        each model reads it after the updates stepped before: exact, at the cost of the overlap of
        one model's update with the other's forward. Without a shared parameter nothing waits (one
        set test per other live engine each forward).
    """
    for other in live_engines():
        if other is not engine and other.updates.pending() and not other.parameter_ids.isdisjoint(ids):
            other.updates.finish_all()


def _check_layout(layers: Iterable[nn.Module]) -> None:
    """Call the ``check_layout`` a layer may carry (a callable attribute) before a layout: it refuses,
    with a message of its own, registrations its layers cannot run, which the layout would refuse with a
    generic one or not at all (a causal LM's stages: Note: [PEFT models] in ``offload/integrations/peft.py``).
    Raising there leaves the slices as they were laid out."""
    for layer in layers:
        check = layer.__dict__.get("check_layout")
        if check is not None:
            check()


def _before_layout(engine: Engine | None, layers: Sequence[nn.Module]) -> None:
    """Before ``engine`` (``None``: one being built) lays ``layers`` out: their own checks
    (:func:`_check_layout`), then the pending updates of the other models that hold the parameters
    they register now, which the layout copies (Note: [Parameters several models hold])."""
    _check_layout(layers)
    settle_other_holders(engine, {id(p) for layer in layers for p in layer.parameters()})


def _check_reassigned(index: int, name: str, new_value: torch.Tensor, target: torch.Tensor,
                      compute_dtype: torch.dtype | None) -> None:
    """Refuse a buffer that a layer of slice ``index`` assigned anew in forward (``self.count =
    self.count + 1``) with another shape or dtype than its device copy ``target``, into which its
    values are copied: the slot is laid out once for the slice's buffers as they were registered.
    But for a value in the ``compute_dtype`` assigned to a float32 or float64 buffer: under a
    compute dtype buffers keep their dtype, and that cast is exact."""
    if new_value.shape != target.shape:
        change = f"shape {tuple(new_value.shape)} (was {tuple(target.shape)})"
    elif new_value.dtype != target.dtype and not (
            new_value.dtype == compute_dtype and target.dtype in (torch.float32, torch.float64)):
        change = f"dtype {new_value.dtype} (was {target.dtype})"
    else:
        return
    raise RuntimeError(
        f"a layer in slice {index} assigned buffer '{name}' anew in forward with a tensor of {change}. OffloadModel "
        "lays buffers out with the shape and dtype they have when it lays their slice out (when wrapping, and after "
        "layers register other tensors between forwards), so a buffer assigned in forward must keep both. Register "
        f"it with the shape and dtype it takes in forward, before wrapping or between forwards (layer.{name} = "
        f"torch.zeros(..., dtype=...)), or keep it as it is and write into it (self.{name}.copy_(new), which casts "
        "as in plain PyTorch)"
    )


def _check_borrowed(slices: Sequence[Slice]) -> None:
    storages = [s.storage for s in slices]
    for s in slices:
        for entry in s.storage.borrowed:
            holder = slices[holder_of(storages, s.index, entry.tensor)]
            _, dtype = holder.storage.transfer_source_of(entry.tensor)
            if dtype != entry.device_dtype:
                raise ValueError(
                    f"parameter '{entry.sites[0].name}' is shared by slice {holder.index} and slice {s.index}, which "
                    f"compute with it in {dtype} and {entry.device_dtype} (one of them is a batch or instance norm "
                    "under compute_dtype); put the layers that share it in one slice"
                )