"""Autograd's saved tensors in slot memory, by reference: a kept graph must not hold a slot.

Graphs that autograd keeps across slot reuse (the last slice's, or every slice's without
activation checkpointing) must not hold slot memory: the slot may hold another slice when
backward reaches them. :meth:`SlotReferences.saved_tensors_hooks` replaces every slot tensor that
autograd saves with a *slot reference* (slice, dtype, shape, strides, offset) and resolves it
again, after the slice has been loaded back, when backward unpacks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from .slot import Slot


@dataclass(frozen=True)
class SlotReference:
    """What a saved slot tensor is, independent of which slot holds its slice later.

    ``version_of`` shares the saved tensor's version counter (it is the tensor detached), so an
    in-place change between forward and backward is caught as autograd would catch it.
    """

    slice_index: int
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    byte_offset: int
    version_of: torch.Tensor
    version: int


@dataclass(frozen=True)
class _SavedTensor:
    """A saved tensor other than slot memory: detached, so the graph holds no cycle through its
    own outputs, with the version it had when saved."""

    tensor: torch.Tensor
    version: int


def _check_version(saved: torch.Tensor, version: int) -> None:
    if saved._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{saved.type()} {list(saved.shape)}] is at version {saved._version}; expected "
            f"version {version} instead."
        )


class SlotReferences:
    """Saved slot tensors as :class:`SlotReference` s, and back.

    Args:
        slots: the device slots, as :class:`~offload.streams.DeviceSlots` holds them.
    """

    def __init__(self, slots: Sequence[Slot]) -> None:
        self._slots = slots

    def saved_tensors_hooks(self) -> saved_tensors_hooks:
        """Hooks under which autograd saves slot tensors as :class:`SlotReference` s."""
        return saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        reference = self.reference(tensor)
        return reference if reference is not None else _SavedTensor(tensor.detach(), tensor._version)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _SavedTensor):
            _check_version(packed.tensor, packed.version)
            return packed.tensor
        return self.resolve(packed)

    def reference(self, tensor: torch.Tensor) -> SlotReference | None:
        """A slot reference to ``tensor`` if it lives in a slot (a parameter's or buffer's device
        copy, or a view of one), else ``None``."""
        try:
            ptr = tensor.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        for slot in self._slots:
            if slot.slice_index is not None and slot.data.untyped_storage().data_ptr() == ptr:
                return SlotReference(slot.slice_index, tensor.dtype, tensor.size(), tuple(tensor.stride()),
                                     tensor.storage_offset() * tensor.element_size(), tensor.detach(),
                                     tensor._version)
        return None

    def resolve(self, packed: SlotReference) -> torch.Tensor:
        """The tensor a slot reference names, in the slot that holds its slice now (acquired)."""
        _check_version(packed.version_of, packed.version)
        slot = next((slot for slot in self._slots if slot.slice_index == packed.slice_index), None)
        if slot is None or not slot.in_use:
            # Outside the walk's backward nothing acquires the slice: autograd reached the kept graph
            # from a tensor that left the model some other way (Note: [Activations used outside the
            # model] in offload/autograd/slice_graph.py).
            raise RuntimeError(
                f"OffloadModel: autograd reached slice {packed.slice_index}'s kept graph while the slice was not "
                "on the device. Most likely an activation made inside the OffloadModel was used outside it: "
                "captured by a forward hook or stored in an attribute, then used in the loss (deep supervision, "
                "feature matching, a perceptual loss). Its gradient cannot reach the layers before it: return the "
                "activation from the model as part of its output instead. Otherwise this is an internal error "
                "of OffloadModel: the slice must be acquired before its kept graph runs backward"
            )
        typed = slot.data.view(packed.dtype) if packed.dtype != torch.uint8 else slot.data
        view = typed.as_strided(packed.size, packed.stride, packed.byte_offset // packed.dtype.itemsize)
        # Its ``.data``: the same memory under a version counter of its own, made without an
        # operator (no allocation). A view would share the slot buffer's counter, which every load
        # into the slot bumps: a graph built from it (a layer's torch.autograd.grad(...,
        # create_graph=True) in forward saves it again) would see a load of another slice as an
        # in-place change (Note: [Layers that differentiate in forward] in
        # offload/autograd/slice_graph.py). In-place changes are caught by the version check
        # above, on the tensor autograd saved.
        return view.data
