"""The model's latch over the write-backs of its masters on disk that failed (Note: [Masters on
disk], "Errors", in ``offload/tiers/master_files.py``): which failures a load replaced, slice by
slice, the refusal of a save while one is left, and the checkpoint that refusal says to reload.

What this file holds: :class:`MastersLatch`, the base of
:class:`~offload.tiers.master_files.MasterFiles`. What it does not: the writes and how their
failures are kept (``master_files.py``, ``offload/streams/masters_io.py``), the model's load hooks
that tell it what a load wrote (``watch_loads`` in ``master_files.py``), or an optimizer's own
latch (``offload/optimizing/partial_failure.py``).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import torch

from ..streams.masters_io import Unwritten, failed_write_backs, latched_text


class MastersLatch(abc.ABC):
    """The failed write-backs of a model's masters, by slice, and the loads that replaced them
    (Note: [Masters on disk], "Errors"): ``save_checkpoint`` of the model refuses while one is left."""

    def __init__(self) -> None:
        # - The writer's failures (numbered, by slice; the storages keep their own).
        self._failures: dict[int, Unwritten] = {}
        # - What loads replaced: the count of failures at the last load of every parameter that
        #   trains, and at the last load of each parameter (by id) since; the checkpoints saved
        #   since that last load of every one (by: with an optimizer's state).
        self._loaded_at = 0
        self._written_at: dict[int, int] = {}
        self._saves: dict[bool, Path] = {}

    @abc.abstractmethod
    def wait(self) -> None:
        """Wait for every write submitted so far (:class:`~offload.tiers.master_files.MasterFiles`'s)."""

    def failures(self, slices: Iterable[Any], after: int | None = None) -> dict[int, Unwritten]:
        """The failed write-backs by slice, each slice's last: the writer's and those of ``slices``'
        storages (Note: [A write-back outside the masters' writer]). Those numbered after ``after``
        (an optimizer's last look), or, ``None``, those the model latches still: no load since
        replaced the slice's parameters (:meth:`_replaced`)."""
        slices = list(slices)
        found: dict[int, Unwritten] = {}
        storages = ((s.index, getattr(s.storage, "unwritten", None)) for s in slices)  # a resident one records none
        for index, record in [*self._failures.items(), *storages]:
            newer = record is not None and record.number > getattr(found.get(index), "number", 0)
            if newer and record.number > (after or 0):
                found[index] = record
        if after is None:
            by_index = {s.index: s for s in slices}
            found = {index: r for index, r in found.items() if not self._replaced(by_index.get(index), r.number)}
        return found

    def _replaced(self, piece: Any, number: int) -> bool:
        """Whether loads after failure ``number`` wrote every parameter of slice ``piece`` that trains
        (Note: [Masters on disk], "Errors"): only those can hold values its file does not; a slice
        none of whose parameters trains, only a load of every parameter of the model that trains."""
        if number <= self._loaded_at:
            return True
        trained = [] if piece is None else [p for layer in piece.layers for p in layer.parameters() if p.requires_grad]
        return bool(trained) and all(self._written_at.get(id(p), 0) >= number for p in trained)

    def refuse_unwritten(self, slices: Iterable[Any], doing: str, optimizer: bool) -> None:
        """Raise while a failed write-back is latched (no load replaced its slice's parameters
        since): ``doing`` would save values that may revert (``optimizer``: the save holds an
        optimizer's state too).

        Raises:
            RuntimeError: the failure, and the checkpoint to reload.
        """
        self.wait()
        failed = self.failures(slices)
        if failed:
            raise RuntimeError(
                f"this OffloadModel's parameters may not be the ones it trained: {latched_text(failed)}. {doing} "
                f"would save them; fix the disk, then reload the last checkpoint saved before this error "
                f"({self.load_call(optimizer)}), or load the parameters of those slices (load_state_dict()), "
                "before saving")

    def load_call(self, optimizer: bool) -> str:
        """The call that loads the last checkpoint saved since the last load of every parameter (of
        them and, ``optimizer``, an optimizer's state), while it is there, else what ``latest`` names."""
        path, args = self._saves.get(optimizer), "model, optimizer" if optimizer else "model"
        if path is not None and path.is_dir():  # a refusal's cost, not a step's
            return f"load_checkpoint({str(path)!r}, {args})"
        return f"load_checkpoint(latest_checkpoint(directory), {args})"

    def saved(self, path: str | os.PathLike[str], optimizer: bool) -> None:
        """A save of the model into ``path`` succeeded (``optimizer``: with an OffloadOptimizer's state)."""
        self._saves[False] = Path(os.path.abspath(path))
        if optimizer:
            self._saves[True] = self._saves[False]

    def parameters_loaded(self, written: Collection[torch.Tensor] | None = None,
                          present: Iterable[torch.Tensor] = ()) -> None:
        """A load wrote ``written`` of the model's parameters ``present`` (``None``: every one that
        trains). The failures before it of each slice whose every trained parameter it wrote are
        replaced; a load of every one also replaces the checkpoints saved before it (they may hold
        another line of steps than the one loaded)."""
        self.wait()
        count = failed_write_backs()
        if written is None:
            self._loaded_at, self._written_at, self._saves = count, {}, {}
            return
        # Only the parameters there now: an id may be another tensor's once its own is gone.
        ids = {id(p) for p in present}
        self._written_at = {i: at for i, at in self._written_at.items() if i in ids}
        self._written_at.update((id(p), count) for p in written)
