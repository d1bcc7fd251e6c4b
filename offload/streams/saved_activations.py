"""The tensors autograd saves while one slice runs on one microbatch, offloaded as they are produced
and loaded back ahead of that run's backward (Note: [Three ways to keep a slice's activations] in
``offload/walk/activation_policy.py``).

Note: [Offloaded saved tensors]
    Under :meth:`SavedActivations.hooks`, every tensor autograd saves is packed as one of:

    1. a *slot reference*, if it lives in a slot (the slice's parameters and buffers, views of
       them): the walk loads the slice again before its backward, so copying it out would move
       the same bytes twice (``DeviceSlots.reference``);
    2. itself, if it is small (under ``min_bytes``), not on the compute device, or not a plain
       strided tensor: it stays where it is, as in a kept graph;
    3. an *offloaded save*: its addressed memory (Note: [Layouts]) copied into a pooled host buffer
       on the offload stream, with no private snapshot first (``ActivationOffloader.offload_saved``);
       the device tensor is freed as soon as forward drops it.

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

    The host copies are held only by the graph (through the packed saves), so their pooled buffers
    return to the pool when autograd frees the graph; each buffer remembers its last load, which
    the next offload into it waits for.
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
from .device_slots import DeviceSlots, SlotReference


@dataclass(eq=False)
class OffloadedSave:
    """One saved tensor on the host (rule 3 of Note: [Offloaded saved tensors]).

    Attributes:
        host: the host copy, valid once ``ticket.ready`` completes.
        ticket: what loading it back needs.
        version: the saved tensor's version when it was saved.
        saved: a weak reference to the tensor autograd saved, for the version check.
        device: the device copy while loaded, else ``None``.
        ready: the device copy's ready event.
    """

    host: torch.Tensor
    ticket: OffloadTicket
    version: int
    saved: weakref.ref[torch.Tensor] | None
    device: torch.Tensor | None = None
    ready: Event | None = None
    changed: torch.Tensor | None = None  # the tensor, if it was changed in place by the end of its run


@dataclass(eq=False)
class _KeptSave:
    """A saved tensor kept where it is (rule 2), detached, with its version when saved."""

    tensor: torch.Tensor
    version: int


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

    @property
    def copies(self) -> CopyStreams:
        return self.offloader.copies

    @property
    def nbytes(self) -> int:
        """Host bytes the offloaded saves hold."""
        return sum(save.host.numel() * save.host.element_size() for save in self.offloaded)

    def hooks(self) -> saved_tensors_hooks:
        """Hooks under which the run's saved tensors are packed by rule (Note: [Offloaded saved tensors])."""
        return saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        reference = self.slots.reference(tensor)
        if reference is not None:
            return reference
        if (tensor.device != self.copies.device or tensor.layout != torch.strided
                or tensor.numel() * tensor.element_size() < max(self.min_bytes, 1)):
            return _KeptSave(tensor.detach(), tensor._version)
        host, ticket = self.offloader.offload_saved(tensor)
        try:
            saved: weakref.ref[torch.Tensor] | None = weakref.ref(tensor)
        except TypeError:
            saved = None
        save = OffloadedSave(host, ticket, tensor._version, saved)
        self.offloaded.append(save)
        return save

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, SlotReference):
            return self.slots.resolve(packed)
        if isinstance(packed, _KeptSave):
            _check_version(packed.tensor, packed.version)
            return packed.tensor
        _check_version(packed.changed, packed.version)
        _check_version(packed.saved() if packed.saved is not None else None, packed.version)
        if packed.device is None:
            raise RuntimeError("internal error: an offloaded saved tensor was unpacked before its run's backward "
                               "loaded it")
        return packed.device

    def seal(self) -> None:
        """The run is over: note the saved tensors it changed in place after saving them."""
        for save in self.offloaded:
            tensor = save.saved() if save.saved is not None else None
            if tensor is not None and tensor._version != save.version:
                # Kept only for the error message (shape, type, version): the run failed anyway.
                save.changed = tensor.detach()

    def _load(self, save: OffloadedSave) -> None:
        save.device, save.ready = self.offloader.load_saved(save.ticket, save.host)

    def load(self) -> None:
        """Start loading every offloaded save not on the device yet (ahead of the run's backward)."""
        for save in self.offloaded:
            if save.device is None:
                self._load(save)

    def wait(self) -> None:
        """Make compute wait for the loads :meth:`load` issued: the run's backward reads them next."""
        for save in self.offloaded:
            if save.device is None:
                self._load(save)
            # Rule 1 of [Copy ordering]: backward reads the device copy.
            self.copies.wait_ready(save.ready)
            save.ready = None

    def release(self) -> None:
        """Drop the device copies once the run's backward has been queued (the allocator keeps
        their memory from other streams until that compute is done: it was allocated on compute)."""
        for save in self.offloaded:
            save.device = None
            save.ready = None
