"""A DCP save planner that reads optimizer state kept on disk one slice at a time, as DCP writes it
(and drops masters kept on disk once written).

It holds :class:`SliceReadingSavePlanner` and nothing else; :func:`offload.save_checkpoint` uses it
(Note: [Checkpoint layout] in ``offload/checkpoint/contents.py``). It does not decide what is saved or
where: the state dict and the file system writer do.

Note: [Slice-by-slice save]
    With a disk tier, the state dict handed to DCP holds, for each optimizer state tensor the tier
    keeps, a stand-in of its shape and dtype (one element of memory): DCP plans from shapes and
    dtypes only. DCP asks its planner for each item's data when it writes the item
    (``SavePlanner.resolve_data``); here the first item of a slice reads that slice's state from
    the tier, its other items take their tensors from it, and the first item of the next slice
    frees it. Three properties of ``FileSystemWriter`` (torch 2.13, ``filesystem.py``) make this
    hold about one slice at a time:

    - Items are written in the plan's order, which is the state dict's: a slice's entries are
      adjacent, so each slice is read once.
    - Only the serial loader (``_SerialCpuLoader``) resolves an item after the previous one was
      written; the overlapping one (chosen when CUDA is available, ``per_thread_copy_ahead > 0``
      and one thread) resolves ahead. The writer is built with ``per_thread_copy_ahead=0`` and one
      thread, so an item's data is asked for only once the previous item is in the file.
    - The writer keeps a reference to every tensor it wrote until the rank's file is closed (its
      ``tensor_dict``, read only by the safetensors format). With the default ``torch.save``
      format the bytes are in the file once the item is written, so the planner frees a finished
      slice's tensors by emptying their storages: the references that remain cost nothing.

    An item of a slice that comes out of order is still right: its slice is read again.

    Masters on disk (``OffloadModel(..., masters=DiskTier(...))``) are read the same way: DCP reads
    each model tensor through its slice's file mapping, and once it asks for a tensor of the next
    slice, the planner writes the previous slice's pages back and drops them, so a save holds
    about one slice's masters in RAM instead of all of them. The writer is serial for them too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan, WriteItem

#: Reads one slice's state: slice index -> {parameter: {state key: tensor}}.
SliceReader = Callable[[int], dict[torch.Tensor, dict[str, torch.Tensor]]]


class SliceReadingSavePlanner(DefaultSavePlanner):
    """DCP's default planner (unflattened), except that the state dict keys in ``on_disk`` are read
    with ``read_slice`` when written, one slice at a time (Note: [Slice-by-slice save]).

    Args:
        read_slice: reads a slice's state tensors; each call returns new tensors the planner owns.
        on_disk: state dict key -> (slice index, parameter, state key) for each stand-in.
    """

    def __init__(self, read_slice: SliceReader | None, on_disk: dict[str, tuple[int, torch.Tensor, str]],
                 masters: dict[str, int] | None = None, release_masters: Callable[[int], None] | None = None) -> None:
        super().__init__(flatten_state_dict=False)
        self._read_slice = read_slice
        self._on_disk = on_disk
        self._index: int | None = None  # the slice whose state is held
        self._held: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self._masters = masters or {}
        self._release_masters = release_masters
        self._masters_index: int | None = None  # the slice whose masters DCP reads now

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        for item in plan.items:
            properties = item.tensor_data.properties if item.tensor_data is not None else None
            if item.index.fqn in self._on_disk and getattr(properties, "strides", None) is not None:
                # A stand-in is a scalar expanded (strides 0), and PyTorch 2.15 and later record
                # strides: record those of the dense tensor written in its place.
                properties.strides = dense_strides(item.tensor_data.size)
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        fqn = write_item.index.fqn
        if fqn in self._masters:
            # A model tensor whose masters are on disk: DCP reads it through the mapping. The
            # previous slice's items are written: its pages go (Note: [Slice-by-slice save]).
            index = self._masters[fqn]
            if index != self._masters_index and self._masters_index is not None:
                assert self._release_masters is not None
                self._release_masters(self._masters_index)
            self._masters_index = index
        where = self._on_disk.get(fqn)
        if where is None:
            return super().resolve_data(write_item)
        assert self._read_slice is not None
        index, param, key = where
        if index != self._index:
            self.release()
            self._held = self._read_slice(index)
            self._index = index
        return self._held[param][key]

    def release(self) -> None:
        """Free the held slice's tensors, although the writer still references them (their bytes
        are in the file)."""
        for tensors in self._held.values():
            for tensor in tensors.values():
                tensor.untyped_storage().resize_(0)
        self._held = {}
        self._index = None


def dense_strides(size: Sequence[int]) -> tuple[int, ...]:
    """The strides of a dense, row-major tensor of ``size``."""
    strides, step = [], 1
    for extent in reversed(size):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))
