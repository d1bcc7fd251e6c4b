"""The copies of a slice that stays on the device: every parameter and buffer in device memory of
its own, updated there, never crossing the link.

Note: [Resident slices]
    ``OffloadModel(..., resident_slices=k)`` keeps the first ``k`` slices on the compute device for
    the whole step: their parameters (the float32 masters under a compute dtype), buffers,
    gradients and optimizer state. They still walk through the device slots like every slice, so
    checkpointing, microbatches, buffer snapshots and recompute treat them exactly as the others;
    only where their copies come from differs:

    1. A load is a device-to-device copy (a cast under a compute dtype) from the parameters into
       the slot, on the compute stream: everything that writes the parameters (an optimizer step,
       the user's code between steps) is queued there too, so the load follows it without any wait
       on the host. There is no shadow: the copy casts.
    2. Buffer write-backs and buffer snapshots copy on the compute stream too.
    3. Their gradients are copied from the summation buffers into device memory of their own, on
       the compute stream, and handed to autograd as the parameters' gradients.
    4. ``OffloadOptimizer`` steps them in ``step()`` with the same optimizer class, on the device,
       before it hands the other slices to the host worker (``offload/optimizing/stepping.py``).

    Why the first slices: a backward finishes with them and the next forward starts with them, so
    theirs are the host updates that the next forward would wait for, and under
    ``update_in_backward`` the last ones to be handed to the host worker.

    Each parameter and buffer gets a device allocation of its own (not a view of one flat buffer),
    so a state dict's tensors share storage exactly where the plain model's do, as on the host
    (Note: [A storage per host copy] in ``host_storage.py``). A slice that borrows a parameter
    from a resident slice (a tied embedding) loads it with a cast on the compute stream too.

Note: [Resident slices on a CPU]
    On a CPU "device" device memory is host memory: a resident slice saves no link, its slot copy
    is the copy in RAM a streamed slice's load is, and its update is the same fused kernel, run in
    ``step()`` on the calling thread instead of beside the next forward on the host worker. So it
    is no faster in float32, and ``offload plan`` keeps no slice resident there unless it predicts
    a gain (``offload/planning/timing.py``).

    It can be far slower on cores that other processes share, for a reason outside this package.
    PyTorch's OpenMP runtime (GNU libgomp) lets a team's threads spin for a while after each
    parallel region, and throttles that spinning only when the process has more OpenMP threads
    than cores. A streamed run has a second team, the host worker's (its update runs parallel
    kernels); a run whose every slice is resident never uses the worker, so its one team spins,
    and with the cores oversubscribed each parallel kernel can wait a scheduler time slice for its
    partner thread. Measured on 2 shared cores at a load of 7-9 (``benchmarks/bench_resident_cpu.py``,
    ``benchmarks/results/resident_cpu_2026-11-28.json``; ``offload-finetune``'s tiny Llama): 2.1 s
    a step resident against 106.5 ms streamed; 55.0 against 62.5 ms with ``OMP_WAIT_POLICY=PASSIVE``;
    77.2 ms resident with one more thread that once ran a parallel kernel. Nothing in the resident
    walk itself costs more: its update is fused AdamW, one call per slice, as the host worker's.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch
from torch import nn

from .flat_views import _itemsize, empty_in_layout, typed_view
from .host_storage import SliceStorage, adopt_meta
from .slice_entries import Entry


class ResidentStorage(SliceStorage):
    """A slice's parameters and buffers kept on ``device`` (Note: [Resident slices]).

    Args:
        layers: the slice's layers.
        device: the compute device.
        compute_dtype: as for :class:`~offload.streams.host_storage.SliceStorage`: the dtype of the
            slot's copies of floating-point parameters; the parameters themselves keep theirs.
        held_elsewhere: ids of the tensors earlier slices hold.
    """

    resident = True
    staged = False  # nothing to cast before a load (Note: [Shadows on disk] in shadow_staging.py)

    def __init__(self, layers: Sequence[nn.Module], device: torch.device, compute_dtype: torch.dtype | None = None,
                 held_elsewhere: Collection[int] = ()) -> None:
        self.device = device
        super().__init__(layers, self._refuse_flat, compute_dtype, held_elsewhere, None)

    def _refuse_flat(self, nbytes: int) -> torch.Tensor:
        raise RuntimeError("internal error: a resident slice has no flat host buffer")

    def _move_in(self) -> None:
        """Give every held tensor device memory of its own, with its values (same Python objects)."""
        self.masters_file = None
        self.flat = None
        self.shadow = None
        self.host_nbytes = 0
        for entry in self.held:
            with torch.inference_mode(False):  # updated in place by training code later
                device = empty_in_layout(entry.shape, entry.stride, entry.dtype, self.device)
            if entry.tensor.is_meta:
                adopt_meta(entry, device)
                continue
            with torch.no_grad():
                device.copy_(entry.tensor.detach())
            entry.tensor.data = device
        self._expected_ptrs = [entry.tensor.data_ptr() for entry in self.entries]
        self._held_by_id = {id(entry.tensor): entry for entry in self.held}
        self._shadow_current = True
        self.shadow_refreshes = 0
        self.shadow_read = None

    @property
    def nbytes(self) -> int:
        """Device bytes of what this slice holds (its parameters and buffers)."""
        return sum(entry.shape.numel() * _itemsize(entry.dtype) for entry in self.held)

    # -- what the slot copies, on the compute stream ---------------------------------------------

    def load_into(self, slot: torch.Tensor) -> None:
        """Copy (casting where the slot's dtype differs) every held tensor into its place in ``slot``."""
        with torch.no_grad():
            for entry in self.held:
                _slot_view(slot, entry).copy_(entry.tensor)

    def load_borrowed_into(self, slot: torch.Tensor, entry: Entry) -> None:
        """Copy a parameter this slice holds into another slice's ``slot`` at ``entry`` (that slice's)."""
        with torch.no_grad():
            _slot_view(slot, entry).copy_(entry.tensor)

    def buffer_bytes(self) -> torch.Tensor:
        """The buffers gathered into new device memory, laid out as in a slot's buffer region."""
        start, end = self.buffer_region
        gathered = torch.zeros(end - start, dtype=torch.uint8, device=self.device)
        with torch.no_grad():
            for entry in self.buffers:
                typed_view(gathered, entry.device_offset - start, entry.dtype, entry.shape,
                           entry.stride).copy_(entry.tensor)
        return gathered

    def write_back_buffers(self, region: torch.Tensor) -> None:
        """Copy a slot's buffer region (``region``) over the buffers."""
        start, _ = self.buffer_region
        with torch.no_grad():
            for entry in self.buffers:
                entry.tensor.copy_(typed_view(region, entry.device_offset - start, entry.dtype, entry.shape,
                                              entry.stride))

    # -- what a host slice has and this one does not ---------------------------------------------

    def transfer_source(self) -> torch.Tensor:
        raise RuntimeError("internal error: a resident slice loads with load_into(), not from a host buffer")

    def transfer_source_of(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        entry = self._held_by_id[id(tensor)]
        return entry.tensor, entry.device_dtype


def _slot_view(slot: torch.Tensor, entry: Entry) -> torch.Tensor:
    return typed_view(slot, entry.device_offset, entry.device_dtype, entry.shape, entry.stride)
