"""A DCP load planner that hands optimizer state to a disk tier one slice at a time, as DCP reads it.

It holds :class:`SliceWritingLoadPlanner` and nothing else; :func:`offload.load_checkpoint` uses
it (Note: [Checkpoint layout] in ``offload/checkpoint/contents.py``). It does not decide what is loaded or
where the tier keeps it: the state dict and the tier do (``StateTier.begin_load`` and
``end_load`` in ``offload/tiers/disk_tier.py``).

Note: [Slice-by-slice load]
    Without it, every saved state tensor the tier keeps needs a destination before DCP reads
    anything: the whole optimizer state, in host memory at once, before ``load_state_dict()``
    moves it to disk. Here the state dict handed to DCP holds, for each of those tensors, a
    stand-in of its saved shape and dtype (one element of memory): DCP plans from shapes only.
    DCP asks the planner for each item's destination when it reads the item
    (``LoadPlanner.resolve_tensor``) and tells it when the item is in (``commit_tensor``). The
    first item of a slice opens the slice: the tier lays out its file and lends a buffer of its
    window in that layout, whose views are the destinations of the slice's items (or, for a tensor saved in
    another dtype than the optimizer keeps, a tensor of the saved dtype, cast into its view as
    ``torch.optim``'s ``load_state_dict()`` casts it). Once the last of the slice's items is
    committed, the tier writes the buffer to the slice's file and the planner drops it. Three
    properties of ``FileSystemReader.read_data`` (torch 2.13, ``filesystem.py``) make this hold
    about one slice at a time:

    - It groups the plan's items by file, files in the order of their first item, and reads each
      file's items in the plan's order. ``dcp.load`` plans from the state dict's keys sorted by
      name, which can interleave slices (``10.weight`` sorts before ``2.weight``), so the planner
      reorders its final plan (``finish_plan``): every other item first, then the slices' items,
      slice after slice. A checkpoint saved by one rank, or loaded by as many ranks as saved it,
      keeps each rank's state in one file: each slice then opens, fills and closes in turn.
    - It resolves an item, copies into it and commits it before it resolves the next one, on
      one thread, and keeps what the planner returned only until it resolves the next item: a
      slice's buffer is free once written.
    - It reads each item with ``torch.load`` into a tensor of its own, copies that into the
      destination, and drops it when the next item's is read: besides the slice, host memory
      holds at most two such tensors (32 MiB for the mlp preset's 16 MiB tensors).

    Items that come out of order are still right, only held longer: each slice counts its items
    in the final plan and is written once the last one is in, however many slices are open
    meanwhile (each with a buffer of its own; the window's buffers serve up to three of them). A
    checkpoint saved by two ranks and loaded by one has most slices' state in both ranks' files:
    every such slice opens while the first file is read and closes while the second is, so the
    load holds nearly the whole state, as loading through ``load_state_dict()`` does.

    Opening, counting and writing a slice take a lock, which ``FileSystemReader`` does not need
    (one thread): a storage reader that fills items on several threads would otherwise open a
    slice once per thread that resolves one of its first items at the same time, and write only
    the buffer opened last, the other items lost without an error. With the lock it is exact,
    only holding more slices at once.

    A write that fails leaves its slice's state held in RAM, in its buffer (Note: [Disk tier
    failures] in ``offload/tiers/disk_tier.py``); the load goes on, and raises ``DiskTierError`` once
    the rest of the state is loaded. A read that fails (a damaged file) raises from DCP: the
    slices written until then hold the checkpoint's state tensors, the others their own, and the
    scalars, read before the slices (into the optimizer's own ``step`` tensors where it has
    them), may be either; a fresh optimizer has no ``step`` for the slices written, and its next
    update would fail on it. Stepping or saving would use that mix, so ``load_checkpoint`` has
    the tier note the failure (``StateTier.load_failed``, also on the error) and the optimizer
    refuses ``step()``, ``state_dict()`` and ``save_checkpoint`` until a load succeeds: load the
    checkpoint again.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem


class OpenSlice(Protocol):
    """One slice being loaded: where each of its state tensors goes, and what writes them."""

    #: {parameter: {state key: the tensor DCP loads that state tensor into}}
    tensors: dict[torch.Tensor, dict[str, torch.Tensor]]

    def store(self) -> None:
        """Every tensor is loaded: hand them to the tier (written to the slice's file)."""


#: Opens one slice: (slice index, {parameter: {state key: stand-in of the saved shape and dtype}}).
SliceOpener = Callable[[int, dict[torch.Tensor, dict[str, torch.Tensor]]], OpenSlice]


class SliceWritingLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner (unflattened), except that the state dict keys in ``on_disk`` are
    loaded a slice at a time into what ``open_slice`` returns, stored once each slice is complete
    (Note: [Slice-by-slice load]).

    It also drops masters on disk as they are loaded: once every model tensor of a slice whose
    masters are on disk is committed, ``release_masters`` writes that slice's pages back and
    drops them, so a load dirties about one slice's masters at a time, not all of them.

    Args:
        open_slice: opens a slice, given the stand-ins of its state tensors (``None``: no state
            goes to a disk tier).
        on_disk: state dict key -> (slice index, parameter, state key) for each stand-in.
        masters: state dict key -> slice index, for the model tensors whose masters are on disk.
        release_masters: writes a slice's masters back and drops them.
    """

    def __init__(self, open_slice: SliceOpener | None, on_disk: dict[str, tuple[int, torch.Tensor, str]],
                 masters: dict[str, int] | None = None, release_masters: Callable[[int], None] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._open_slice = open_slice
        self._on_disk = on_disk
        self._masters = masters or {}
        self._release_masters = release_masters
        self._masters_left: dict[int, int] = {}  # per slice, its model items not committed yet
        self._keys: dict[int, list[str]] = {}  # per slice, its keys in on_disk
        for fqn, (index, _, _) in on_disk.items():
            self._keys.setdefault(index, []).append(fqn)
        self._open: dict[int, OpenSlice] = {}
        self._items_left: dict[int, int] = {}  # per slice, its items not committed yet
        # Opening, counting and storing a slice: one thread at a time (a reader may fill items on several).
        self._lock = threading.Lock()
        #: The slices loaded and stored, in the order they were stored.
        self.stored: list[int] = []

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        def order(item: ReadItem) -> tuple[int, int]:
            where = self._on_disk.get(item.dest_index.fqn)
            return (0, 0) if where is None else (1, where[0])

        items = sorted(new_plan.items, key=order)  # stable: each slice's items in the plan's order
        self._items_left = {}
        self._masters_left = {}
        for item in items:
            where = self._on_disk.get(item.dest_index.fqn)
            if where is not None:
                self._items_left[where[0]] = self._items_left.get(where[0], 0) + 1
            index = self._masters.get(item.dest_index.fqn)
            if index is not None:
                self._masters_left[index] = self._masters_left.get(index, 0) + 1
        return dataclasses.replace(super().finish_plan(new_plan), items=items)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        where = self._on_disk.get(read_item.dest_index.fqn)
        if where is None:
            return super().resolve_tensor(read_item)
        index, param, key = where
        with self._lock:
            opened = self._open.get(index)
            if opened is None:
                assert self._open_slice is not None
                stand_ins: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
                for fqn in self._keys[index]:
                    _, p, name = self._on_disk[fqn]
                    stand_ins.setdefault(p, {})[name] = self.state_dict[fqn]
                opened = self._open[index] = self._open_slice(index, stand_ins)
            destination = opened.tensors[param][key]
        return self.transform_tensor(read_item, destination)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        where = self._on_disk.get(fqn)
        if where is None:
            super().commit_tensor(read_item, tensor)
            index = self._masters.get(fqn)
            if index is not None:
                with self._lock:
                    self._masters_left[index] -= 1
                    done = self._masters_left[index] == 0
                if done:  # the slice's masters are loaded: to their file, out of RAM
                    assert self._release_masters is not None
                    self._release_masters(index)
            return
        index = where[0]
        with self._lock:
            self._items_left[index] -= 1
            if self._items_left[index] == 0:
                self._open.pop(index).store()  # every item of the slice is committed, so filled
                self.stored.append(index)

    def check_complete(self) -> None:
        """Raise unless every slice of ``on_disk`` was loaded and stored (after ``dcp.load``)."""
        if self._open or sorted(self.stored) != sorted(self._keys):
            raise RuntimeError(f"internal error: slices {sorted(self._keys)} were to be loaded, {self.stored} were "
                               f"stored and {sorted(self._open)} are still open")

    def release(self) -> None:
        """Drop the slices still open (a load that failed): their state was not stored."""
        self._open = {}
