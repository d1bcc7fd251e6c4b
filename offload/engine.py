"""The slices of one model and the machinery that moves them: what a forward or backward walk uses.

An :class:`Engine` is built once per :class:`~offload.OffloadModel`. It holds no per-call state:
everything a backward needs from its forward travels in the autograd context, so several forwards
may be in flight before their backwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .binding import Binding
from .milestones import Milestones
from .streams import (
    ActivationOffloader,
    CopyStreams,
    DeviceSlots,
    GradientOffloader,
    HostBufferPool,
    OffloadTicket,
    SliceStorage,
    SliceUpdates,
    holder_of,
)


@dataclass
class Slice:
    """A contiguous run of layers that is loaded and run as a unit."""

    index: int
    names: list[str]
    layers: list[nn.Module]
    storage: SliceStorage

    def run(self, inputs: Any) -> Any:
        # nn.Sequential semantics: each layer gets the previous layer's output as its one argument.
        for layer in self.layers:
            inputs = layer(inputs)
        return inputs


@dataclass
class SliceResult:
    """What running a slice on one microbatch produced.

    Attributes:
        output: the slice's output.
        buffers_changed: the run changed the slice's buffers on the device (see Note: [Buffers]
            in ``offload/autograd/function.py``).
    """

    output: Any
    buffers_changed: bool


class Engine:
    """Slices, their host storage, device slots and copy streams of one model.

    Args:
        groups: the layers of each slice, with their names.
        device: the compute device.
        host_device: where host copies live (``offload_device``).
        synchronous_copies: force synchronous copies (see :class:`~offload.streams.CopyStreams`).
        compute_dtype: dtype of the device copies of floating-point parameters, or None.
    """

    def __init__(self, groups: Sequence[tuple[list[str], list[nn.Module]]], device: torch.device,
                 host_device: torch.device, synchronous_copies: bool = False,
                 compute_dtype: torch.dtype | None = None) -> None:
        self.device = device
        self.host_device = host_device
        self.compute_dtype = compute_dtype
        self.copies = CopyStreams(device, synchronous=synchronous_copies)
        self.pin = self.copies.pins_host_memory and host_device.type == "cpu"

        def allocate(nbytes: int) -> torch.Tensor:
            return self.copies.empty_host(nbytes, host_device)

        self.slices: list[Slice] = []
        held: set[int] = set()  # what earlier slices hold (Note: [Tied parameters across slices])
        for i, (names, layers) in enumerate(groups):
            storage = SliceStorage(layers, allocate, compute_dtype, held)
            self.slices.append(Slice(i, names, layers, storage))
            held.update(id(e.tensor) for e in storage.held)
        _check_borrowed(self.slices)
        self.pool = HostBufferPool(allocate)
        #: the OffloadOptimizers stepping this model, for its memory footprint
        self.optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.milestones = Milestones()
        self.activations = ActivationOffloader(self.copies, self.pool)
        self._build_device_side()

    def _build_device_side(self) -> None:
        storages = [s.storage for s in self.slices]
        needed = max(st.device_nbytes for st in storages)
        slots = getattr(self, "slots", None)
        if slots is not None:
            self.updates.adopt(storages)
        else:
            self.updates = SliceUpdates(self.copies, storages)
        if slots is not None and slots.slot_nbytes >= needed:
            # Keep the slots object: graphs still waiting for backward resolve their slot
            # references through it.
            slots.adopt(storages)
        else:
            self.slots = DeviceSlots(storages, self.copies, self.updates)
        self.gradients = GradientOffloader(self.copies, self.pool, max(st.grad_nbytes for st in storages))

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    def traffic(self) -> tuple[int, int]:
        """Bytes loaded (host to device) and offloaded (device to host) since the model was built."""
        return self.copies.loaded_bytes, self.copies.offloaded_bytes

    def parameters(self) -> list[nn.Parameter]:
        """Every parameter, slice by slice, in the order the autograd Function receives them."""
        return [entry.tensor for s in self.slices for entry in s.storage.params]  # type: ignore[misc]

    def refresh(self) -> None:
        """Follow changes the user made to parameters since the last call.

        ``p.data = other`` or assigning a new ``nn.Parameter`` to a layer takes the tensor out of the
        slice's flat host buffer; the slice is laid out again so the next load sees the change.
        """
        if not any(s.storage.moved() or s.storage.registered_tensors_changed() for s in self.slices):
            return  # the common case, checked every forward
        held: set[int] = set()
        for s in self.slices:
            # Earlier slices first: what a slice borrows depends on what they hold now.
            if s.storage.moved() or s.storage.registered_tensors_changed() or held != s.storage.held_elsewhere:
                s.storage.held_elsewhere = frozenset(held)
                s.storage.build()
            held.update(id(e.tensor) for e in s.storage.held)
        _check_borrowed(self.slices)
        self._build_device_side()

    def to_device(self, leaves: Sequence[Any]) -> list[Any]:
        """The leaves with every tensor on the compute device, ready for compute."""
        moved: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.device != self.device:
                tensor, ready = self.activations.load_host(leaf)
                self.copies.wait_ready(ready)
                moved.append(tensor)
            else:
                moved.append(leaf)
        return moved

    def run_slice(self, index: int, tensors: Sequence[torch.Tensor], inputs: Any) -> SliceResult:
        """Run slice ``index`` on ``inputs`` with ``tensors`` (one per storage entry) in place of the
        host copies. The slice must be acquired.
        """
        s = self.slices[index]
        has_buffers = bool(s.storage.buffers)
        written_before = self.slots.write_counter(index) if has_buffers else 0
        sites = [entry.sites for entry in s.storage.entries]
        with Binding(sites, tensors) as binding:
            output = s.run(inputs)
        # An output that aliases the slot (a layer returning a weight or a view of one) would change
        # under the caller's feet when the slot is reused: give it memory of its own.
        output = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and self.slots.owns(t) else t, output)
        for position, new_value in binding.reassigned:
            target = tensors[position]
            if new_value.shape != target.shape:
                raise RuntimeError(
                    f"a layer in slice {index} replaced buffer '{sites[position][0].name}' with a tensor of "
                    f"shape {tuple(new_value.shape)} (was {tuple(target.shape)}); OffloadModel keeps buffers "
                    "at a fixed size: update them in place instead"
                )
            with torch.no_grad():
                target.copy_(new_value)
        changed = has_buffers and (
            bool(binding.reassigned)
            or self.slots.write_counter(index) != written_before
            or s.storage.has_running_stats_in_training()
        )
        return SliceResult(output, changed)

    def keep_buffers_of_failed_run(self, index: int) -> None:
        """A forward failed inside slice ``index``: write its device buffers back as the run left
        them, so the host holds what the plain model's layers leave behind after the same failure
        (the layers before the failing one updated, the rest not). Slices before it were written
        back already; slices after it never ran."""
        if self.slices[index].storage.buffers:
            # Issued only: the drain that follows every failure (rule 5 of [Copy ordering])
            # completes it before the exception reaches the caller.
            self.slots.write_back_buffers(index)

    def bound(self, index: int, tensors: Sequence[torch.Tensor]) -> Binding:
        """A context in which slice ``index``'s layers see ``tensors`` (one per entry) in place of
        their host copies (see Note: [Device copies while autograd runs a slice])."""
        return Binding([entry.sites for entry in self.slices[index].storage.entries], tensors)

    def offload_buffers(self, index: int) -> tuple[torch.Tensor, OffloadTicket]:
        """A host copy of the acquired slice's device buffers as they are now."""
        return self.activations.offload(self.slots.buffer_region(index))

    def snapshot_host_buffers(self, index: int) -> tuple[torch.Tensor, OffloadTicket]:
        """A copy of slice ``index``'s host buffers as they are now, in a pooled buffer."""
        return self.activations.copy_on_host(self.slices[index].storage.buffer_bytes())


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