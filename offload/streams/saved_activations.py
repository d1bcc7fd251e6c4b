"""The tensors autograd saves while one slice runs on one microbatch, offloaded as they are produced
and loaded back ahead of that run's backward (Note: [Three ways to keep a slice's activations] in
``offload/walk/activation_policy.py``).

Note: [Offloaded saved tensors]
    Under :meth:`SavedActivations.hooks`, every tensor autograd saves is packed as one of:

    1. a *slot reference*, if it lives in a slot (the slice's parameters and buffers, views of
       them): the walk loads the slice again before its backward, so copying it out would move
       the same bytes twice (``SlotReferences.reference``);
    2. itself, if it is small (under ``min_bytes``), not on the compute device, or not a plain
       strided tensor: it stays where it is, as in a kept graph. So does a tensor with no memory
       of its own to copy: a zero tensor (forward-mode AD's tangent of a tensor that has none,
       ``torch.func.jvp`` or ``make_dual`` inside a layer) or one a ``torch.func`` transform wraps;
    3. an *offloaded save*: its addressed memory (Note: [Layouts]) copied into a pooled host buffer
       on the offload stream, with no private snapshot first (``ActivationOffloader.offload_saved``);
       the device tensor is freed as soon as forward drops it. A tensor that addresses more than
       half of its storage has the whole storage copied instead, once for every view of one base
       the run saves at the same version: attention saves its query, key and value, three views of one
       projection that each address nearly all of it, and copying each view's addressed memory
       would move the projection three times. Views of one storage then share one device copy in
       backward, as they share memory in the plain model, each at its own offset and strides.

    Before the run's backward, :meth:`SavedActivations.load` issues a load for every offloaded save
    (one step ahead, while the run before it is differentiated), :meth:`SavedActivations.wait` makes
    compute wait for them (rule 1 of [Copy ordering]), and unpacking returns the device copy, in
    the saved tensor's layout. :meth:`SavedActivations.release` drops the device copies after the
    run's backward; a second backward (``retain_graph=True``) loads them again. Nothing else
    unpacks them: only the backward walk differentiates the graph.

    Versions: autograd refuses a backward through a saved tensor changed in place since it was
    saved. An offloaded save keeps the version it had and a weak reference to the tensor it was
    given. At the end of the run (:meth:`SavedActivations.seal`) every tensor still alive is
    looked at (the run's outputs, which a layer may have changed after saving them), and at
    unpacking again if it is still alive then; either raises autograd's error. A tensor that was
    changed and dropped after its run, before backward, goes unnoticed (as under
    ``torch.autograd.graph.save_on_cpu``): a program the plain model refuses, never one it accepts.

    The host copies are held only by the graph (through the packed saves) and by the call's
    record of the run, which backward lets go with the graph (unless it is retained), so their
    pooled buffers return to the pool when autograd frees the graph; each buffer remembers its
    last load, which the next offload into it waits for.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from .activations import ActivationOffloader, OffloadTicket
from .backend import Event
from .copies import CopyStreams
from .device_slots import DeviceSlots
from .slot_references import SlotReference
from .layouts import Layout


#: A tensor in a storage's bytes: dtype, size, stride and storage offset (in elements of dtype).
StorageView = tuple[torch.dtype, torch.Size, tuple[int, ...], int]


@dataclass(eq=False)
class HostCopy:
    """Device memory that saved tensors view, copied to a pooled host buffer (rule 3 of Note:
    [Offloaded saved tensors]); loaded back once for all of them.

    Attributes:
        host: the host copy, valid once ``ticket.ready`` completes: a saved tensor's addressed
            memory in its layout, or a whole storage's bytes.
        ticket: what loading it back needs.
        device: the device copy while loaded, else ``None``.
        ready: the device copy's ready event, until compute has waited for it.
    """

    host: torch.Tensor
    ticket: OffloadTicket
    device: torch.Tensor | None = None
    ready: Event | None = None


@dataclass(eq=False)
class OffloadedSave:
    """One saved tensor on the host.

    Attributes:
        copy: the memory it views.
        view: ``(dtype, size, stride, storage offset)`` of the tensor in a whole storage's bytes,
            or ``None`` where ``copy`` is the tensor itself.
        version: the saved tensor's version when it was saved.
        saved: a weak reference to the tensor autograd saved, for the version check.
        changed: the tensor, if its run changed it in place after saving it.
    """

    copy: HostCopy
    view: StorageView | None
    version: int
    saved: weakref.ref[torch.Tensor] | None
    changed: torch.Tensor | None = None

    def device_tensor(self, sealed: bool) -> torch.Tensor:
        """The saved tensor over the device copy (loaded); ``sealed``: its run is over."""
        device = self.copy.device
        if device is None and not sealed:
            raise RuntimeError(
                "OffloadModel: a layer differentiated, inside its forward, a graph built during that forward "
                "(torch.autograd.grad or .backward() in forward, as for a force from an energy), but its slice "
                "offloads its saved tensors (offload_activations): they are on their way to the host until the "
                "slice's backward loads them. Leave the slice out of offload_activations and pass "
                "checkpoint_activation=False (the slice keeps its graph, as in the plain model). If no layer "
                "differentiates inside its forward, this is an internal error of OffloadModel (Note: [Layers "
                "that differentiate in forward] in offload/autograd/slice_graph.py)")
        if device is None:
            # Outside the walk's backward nothing loads it (Note: [Activations used outside the model]
            # in offload/autograd/slice_graph.py).
            raise RuntimeError(
                "OffloadModel: autograd reached a saved tensor of a slice that offloads them (offload_activations) "
                "before that slice's backward loaded it. Most likely an activation made inside the OffloadModel was "
                "used outside it: captured by a forward hook or stored in an attribute, then used in the loss (deep "
                "supervision, feature matching, a perceptual loss). Its gradient cannot reach the layers before it: "
                "return the activation from the model as part of its output instead. Otherwise this is an internal "
                "error of OffloadModel")
        if self.view is None:
            return device
        dtype, size, stride, offset = self.view
        # The storage's bytes keep their alignment at the device copy's storage offset (Note: [Layouts]).
        start = device.storage_offset() // dtype.itemsize
        return torch.empty(0, dtype=dtype, device=device.device).set_(device.untyped_storage(), start + offset,
                                                                     size, stride)


@dataclass(eq=False)
class _KeptSave:
    """A saved tensor kept where it is (rule 2), detached, with its version when saved."""

    tensor: torch.Tensor
    version: int


def _memoryless(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has no storage to copy (rule 2 of Note: [Offloaded saved tensors])."""
    return tensor._is_zerotensor() or torch._C._functorch.is_functorch_wrapped_tensor(tensor)


def _check_version(tensor: torch.Tensor | None, version: int) -> None:
    if tensor is not None and tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected "
            f"version {version} instead."
        )


@dataclass(eq=False)
class SavedActivations:
    """What autograd saved during one run of an offloaded slice (Note: [Offloaded saved tensors]).

    Args:
        offloader: copies saved tensors to pooled host buffers and back.
        slots: recognises and resolves slot tensors.
        min_bytes: smaller saved tensors stay on the device.
    """

    offloader: ActivationOffloader
    slots: DeviceSlots
    min_bytes: int
    offloaded: list[OffloadedSave] = field(default_factory=list)
    # The run is over (Note: [Layers that differentiate in forward] in offload/autograd/slice_graph.py).
    sealed: bool = False
    # Whole storages copied in this run, by (address, bytes, version), with the tensor whose save
    # copied it and its base: the other views of that base saved at the same version share its
    # copy, while that tensor is alive (else its memory may hold another tensor now, at the same
    # address).
    _storages: dict[tuple[int, int, int], tuple[HostCopy, weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = (
        field(default_factory=dict))

    @property
    def copies(self) -> CopyStreams:
        return self.offloader.copies

    @property
    def host_copies(self) -> list[HostCopy]:
        """Each host copy once (views of one storage share theirs)."""
        return list({id(save.copy): save.copy for save in self.offloaded}.values())

    def hooks(self) -> saved_tensors_hooks:
        """Hooks under which the run's saved tensors are packed by rule (Note: [Offloaded saved tensors])."""
        return saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        reference = self.slots.references.reference(tensor)
        if reference is not None:
            return reference
        if (tensor.device != self.copies.device or tensor.layout != torch.strided
                or tensor.numel() * tensor.element_size() < max(self.min_bytes, 1) or _memoryless(tensor)):
            return _KeptSave(tensor.detach(), tensor._version)
        copy, view = self._copy_of(tensor)
        try:
            saved: weakref.ref[torch.Tensor] | None = weakref.ref(tensor)
        except TypeError:
            saved = None
        save = OffloadedSave(copy, view, tensor._version, saved)
        self.offloaded.append(save)
        return save

    def _copy_of(self, tensor: torch.Tensor) -> tuple[HostCopy, StorageView | None]:
        """The host copy a saved tensor views: its storage's, if the tensor addresses most of it
        (attention's query, key and value: three views of one projection, each addressing nearly
        all of it), shared with the other views of it; else its own addressed memory."""
        storage = tensor.untyped_storage()
        span = Layout.of(tensor).span * tensor.element_size()
        if storage.nbytes() > 2 * span:
            return HostCopy(*self.offloader.offload_saved(tensor)), None
        view = (tensor.dtype, tensor.size(), tuple(tensor.stride()), tensor.storage_offset())
        # Only views of one base share a version counter: tensors that alias a storage without
        # being views (``unsafe_chunk``, as PyTorch's CPU GRU and LSTM cells split their gates,
        # ``.data``, ``set_``) count versions of their own, so an equal version says nothing about
        # their bytes, and each gets a copy of its own.
        base = tensor._base if tensor._base is not None else tensor
        key = (storage.data_ptr(), storage.nbytes(), tensor._version)
        known = self._storages.get(key)
        if known is not None and known[1]() is not None and known[2]() is base:
            return known[0], view
        whole = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        copy = HostCopy(*self.offloader.offload_saved(whole))
        try:
            self._storages[key] = (copy, weakref.ref(tensor), weakref.ref(base))
        except TypeError:
            pass  # not shared: each view copies the storage
        return copy, view

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, SlotReference):
            return self.slots.references.resolve(packed)
        if isinstance(packed, _KeptSave):
            _check_version(packed.tensor, packed.version)
            return packed.tensor
        _check_version(packed.changed, packed.version)
        _check_version(packed.saved() if packed.saved is not None else None, packed.version)
        return packed.device_tensor(self.sealed)

    def seal(self) -> None:
        """The run is over: note the saved tensors it changed in place after saving them, and
        forget the storages copied (their memory may be reused for other tensors)."""
        self.sealed = True
        self._storages.clear()
        for save in self.offloaded:
            tensor = save.saved() if save.saved is not None else None
            if tensor is not None and tensor._version != save.version:
                # Kept only for the error message (shape, type, version): the run failed anyway.
                save.changed = tensor.detach()

    def load(self) -> None:
        """Start loading every host copy not on the device yet (ahead of the run's backward)."""
        for copy in self.host_copies:
            if copy.device is None:
                copy.device, copy.ready = self.offloader.load_saved(copy.ticket, copy.host)

    def wait(self) -> None:
        """Make compute wait for the loads :meth:`load` issued (issuing those it did not): the
        run's backward reads them next."""
        self.load()
        for copy in self.host_copies:
            # Rule 1 of [Copy ordering]: backward reads the device copy.
            self.copies.wait_ready(copy.ready)
            copy.ready = None

    def release(self) -> None:
        """Drop the device copies once the run's backward has been queued (the allocator keeps
        their memory from other streams until that compute is done: it was allocated on compute)."""
        for copy in self.host_copies:
            copy.device = None
            copy.ready = None
