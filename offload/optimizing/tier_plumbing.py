"""``TierPlumbing``: an ``OffloadOptimizer``'s side of its disk tier, and nothing without one.

It opens the tier, runs each slice's update through it, flushes its writes where the optimizer
waits, hands the state on disk to ``state_dict()`` and to checkpoints one slice at a time, and
loads a checkpoint's state into the tier's files slice by slice (Note: [Slice-by-slice load] in
``offload/checkpoint/slice_load_planner.py``). What it does not hold: the tier's files, window and
pipeline (``offload/tiers/disk_tier.py``), or the update itself (``offload/tiers/slice_update.py``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from ..streams import Event
from ..streams.copies import CopyStreams
from ..streams.workers import HostWorker
from ..tiers.disk_tier import DiskTier, StateTier
from ..tiers.slice_update import state_box
from ..tiers.state_slice import SliceState
from ..walk.engine import Engine


class TierPlumbing:
    """The optimizer's disk tier (``tier``, ``None`` without one) as the optimizer uses it: each
    method does nothing, or what the optimizer does without a tier, when there is none.

    Args:
        tier: the optimizer's :class:`~offload.tiers.disk_tier.StateTier`, or ``None``.
        copies: the copy engine of the optimizer's model (its workers and waits).
    """

    def __init__(self, tier: StateTier | None, copies: CopyStreams, casts_as_torch_optim: bool = True,
                 owner: TierOwner | None = None) -> None:
        self.tier = tier
        self.copies = copies
        self.casts_as_torch_optim = casts_as_torch_optim  # see loads_on_disk()
        self.owner = owner  # what the tier holds weakly in the optimizer's place

    @classmethod
    def of(cls, disk_tier: DiskTier | str | os.PathLike[str] | None, optimizer: torch.optim.Optimizer,
           engine: Engine, rank: int | None, ranks: int, optimizer_class: type[torch.optim.Optimizer]) -> TierPlumbing:
        """The plumbing of ``optimizer``'s ``disk_tier`` setting (``None``: no tier), the tier opened
        for this rank (``rank`` of ``ranks`` when the update is sharded, else ``None``) and counted in
        the model's memory footprint; ``optimizer_class`` is the class that steps the slices."""
        if disk_tier is None:
            return cls(None, engine.copies)
        setting = disk_tier if isinstance(disk_tier, DiskTier) else DiskTier(disk_tier)
        # A resident slice's state stays on the device (Note: [Resident slices]): no room for it.
        resident = {id(e.tensor) for s in engine.slices if s.storage.resident for e in s.storage.params}
        owner = TierOwner(optimizer)
        tier = StateTier(setting, owner, engine.copies, rank, ranks, resident)  # type: ignore[arg-type]
        engine.disk_tiers.add(tier)
        return cls(tier, engine.copies, casts_as_torch_optim(optimizer_class), owner)

    # -- stepping -------------------------------------------------------------------------------------

    def submit(self, index: int, worker: HostWorker, work: Callable[[], None],
               after: Sequence[Event | None]) -> Event:
        """Run slice ``index``'s update ``work`` on ``worker`` after ``after``, its state read before
        and written after by the tier; returns the update's event. The update worker runs it in
        slice order among the ready (Note: [Updates in the next forward's order] in ``stepping.py``)."""
        if self.tier is None:
            return self.copies.submit(worker, work, after=after, key=index)
        # The tier reads the state through its owner, which it holds weakly: the update holds the
        # owner until it has run, if the optimizer is dropped before (Note: [What an update holds]).
        return self.tier.submit(index, worker, functools.partial(_holding, self.owner, work), after=after)

    def flush(self, when: str = "wait") -> None:
        """Wait for the tier's writes; raise what it could not write (:meth:`StateTier.flush`), saying
        what is true ``when`` (a key of :data:`~offload.tiers.disk_tier.FLUSHED_AT`)."""
        if self.tier is not None:
            self.tier.flush(when)

    def plan(self, slices: Sequence[tuple[int, list[torch.Tensor]]]) -> None:
        """The tier serves these slices (index, the parameters this optimizer steps in it)."""
        if self.tier is not None:
            self.tier.plan(slices)

    def close(self, index_of: dict[int, int]) -> None:
        """Remove the tier's files (or keep them, with their manifest)."""
        if self.tier is not None:
            self.tier.close(index_of)

    # -- the state, one slice at a time ---------------------------------------------------------------

    def slice_state(self, index: int) -> SliceState:
        """Copies of slice ``index``'s state tensors read from the tier (none without one)."""
        return self.tier.slice_state(index) if self.tier is not None else {}

    def slice_layout(self, index: int) -> SliceState:
        """Stand-ins of slice ``index``'s state tensors on disk, its file unread (none without a tier)."""
        return self.tier.slice_layout(index) if self.tier is not None else {}

    def add_to_state_dict(self, packed: dict[str, Any], index_of: dict[int, int]) -> None:
        """Put the state on disk into a packed ``state_dict()``, one slice at a time."""
        if self.tier is not None:
            self.tier.add_to_state_dict(packed, index_of)

    # -- loading ---------------------------------------------------------------------------------------

    def forget(self, keep: Collection[int] = ()) -> None:
        """``optimizer.state`` was replaced: the files no longer hold it, except slices ``keep``'s."""
        if self.tier is not None:
            self.tier.forget(keep)

    def adopt(self) -> None:
        """Move the loaded ``optimizer.state`` to the tier's files, one slice at a time."""
        if self.tier is not None:
            self.tier.adopt()

    def check_loaded(self, doing: str) -> None:
        """Raise if a load into the tier failed part way (Note: [Slice-by-slice load] in
        ``offload/checkpoint/slice_load_planner.py``): ``doing`` would step or save a mix of two states."""
        if self.tier is not None:
            self.tier.check_loaded(doing)

    def loads_on_disk(self, index: int, param: torch.Tensor, key: str, dtype: torch.dtype,
                      shape: torch.Size) -> bool:
        """Whether a checkpoint's state tensor ``key`` of ``param`` (in slice ``index``, saved in
        ``dtype`` and ``shape``) loads straight into the tier, a slice at a time: the tier would keep
        it on disk once ``load_state_dict()`` cast it. Never ``step``, whose cast depends on the
        saved groups' ``fused`` and ``capturable``, nor a tensor without elements (there is nothing
        to read), nor any state of a class that loads with rules of its own (:func:`casts_as_torch_optim`):
        its ``load_state_dict()`` places that state, and the tier takes it from there."""
        if (self.tier is None or not self.casts_as_torch_optim or key == "step" or len(shape) == 0
                or any(n == 0 for n in shape)):
            return False
        return self.tier.keeps(index, param, as_loaded(param, key, torch.empty(0, dtype=dtype)))

    def open_slice_load(self, index: int, saved: SliceState) -> TierSliceLoad:
        """Where a checkpoint loads slice ``index``'s state tensors that the tier keeps, given
        stand-ins of their saved shapes and dtypes; its ``store()`` writes them to the slice's file."""
        assert self.tier is not None
        return TierSliceLoad(self.tier, index, saved)


class TierOwner:
    """The disk tier's optimizer, as the tier knows it: what its files are sized for, and the box
    that holds the optimizer's ``state`` (Note: [What an update holds] in
    ``offload/tiers/slice_update.py``), through which the tier reads the state, on the update worker
    too. In the optimizer's place: an update still pending when the optimizer is dropped runs to its
    end, and would find the optimizer gone."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_class = optimizer.optimizer_class  # type: ignore[attr-defined]
        self.param_groups = optimizer.param_groups  # read once, to size the files
        self._held_state = state_box(optimizer)  # where held_state() looks


def _holding(owner: TierOwner | None, work: Callable[[], None]) -> None:
    """Run ``work``; ``owner`` is an argument only to be held until then."""
    work()


class TierSliceLoad:
    """One slice's state tensors that a checkpoint loads into the disk tier (Note: [Slice-by-slice
    load] in ``offload/checkpoint/slice_load_planner.py``).

    ``tensors`` are views of the tier's buffer, laid out as its file, where the saved dtype is the
    one ``load_state_dict()`` would keep; otherwise tensors of the saved dtype, which :meth:`store`
    casts into their views as ``load_state_dict()`` casts them: the state is the same bit for bit.
    """

    def __init__(self, tier: StateTier, index: int, saved: SliceState) -> None:
        self._tier = tier
        kept = {p: {key: torch.empty(s.shape, dtype=as_loaded(p, key, torch.empty(0, dtype=s.dtype)).dtype,
                                     device="meta") for key, s in states.items()} for p, states in saved.items()}
        self._loading = self._tier.begin_load(index, kept)
        self.tensors = {p: {key: view if view.dtype == saved[p][key].dtype
                            else torch.empty(saved[p][key].shape, dtype=saved[p][key].dtype)
                            for key, view in views.items()} for p, views in self._loading.tensors.items()}

    def store(self) -> None:
        """Every tensor is loaded: cast those of another dtype into their views, and write the slice."""
        for p, tensors in self.tensors.items():
            for key, tensor in tensors.items():
                view = self._loading.tensors[p][key]
                if tensor is not view:
                    view.copy_(as_loaded(p, key, tensor))
        self.tensors = {}
        self._tier.end_load(self._loading)


def as_loaded(param: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` as ``torch.optim``'s ``load_state_dict()`` puts it into ``param``'s state under
    ``key`` (any key but ``step``): the function it casts with, which casts to the parameter's
    dtype (floating point) and device."""
    assert key != "step", "internal error: the cast of step depends on the saved groups"
    # The groups tell only step's cast (fused, capturable); any list naming the parameter does.
    return torch.optim.Optimizer._process_value_according_to_param_policy(param, value, 0, [{"params": [0]}], key)


def casts_as_torch_optim(optimizer_class: type[torch.optim.Optimizer]) -> bool:
    """Whether ``optimizer_class`` loads its state with ``torch.optim``'s ``load_state_dict()``,
    which casts every state tensor but ``step`` to its parameter's dtype (:func:`as_loaded`), not with
    a ``load_state_dict()`` of its own: bitsandbytes' 8-bit optimizers keep their uint8 codes and
    float32 quantization maps as saved."""
    return optimizer_class.load_state_dict is torch.optim.Optimizer.load_state_dict
