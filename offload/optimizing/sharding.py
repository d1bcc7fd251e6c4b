"""``Sharding``: a sharded update's exchange across ranks. Each rank updates the parameters it owns
and every rank then takes each updated parameter from its owner. What it does not hold: the
collectives themselves (``offload/streams/collectives.py``) or the update of a slice
(``offload/tiers/slice_update.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..model import OffloadModel, engine_of
from ..streams import Event
from ..streams.collectives import CollectiveError, HostCollectives
from ..tiers.slice_update import SliceStep
from .partial_failure import Handed

#: A slice's parameters as the plan lists them: (position in the slice, parameter, user group).
Item = tuple[int, torch.Tensor, int]


class Sharding:
    """Who owns each parameter of a sharded update, and the exchange of the updated parameters.

    Args:
        collectives: the host collectives over the ranks that share the update.
    """

    def __init__(self, collectives: HostCollectives) -> None:
        self.collectives = collectives
        #: Per slice: every rank's parameters of it, in memory order, and the rank that owns each.
        self.shared: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        self._compared: list[Any] | None = None  # the last plan every rank was found to share
        self._made: list[Any] | None = None  # the last plan made

    @classmethod
    def of(cls, model: OffloadModel, shard: bool | None, process_group: Any) -> Sharding | None:
        """The sharding of an optimizer over ``model`` (``shard`` and ``process_group`` as
        ``OffloadOptimizer`` takes them), or ``None`` when every rank updates everything.

        Raises:
            ValueError: ``shard=True`` without a process group, or over NCCL.
        """
        data_parallel = model.__dict__.get("_data_parallel")
        group = process_group if process_group is not None else (
            data_parallel.group if data_parallel is not None else None)
        if shard is None:
            shard = group is not None and dist.get_world_size(group) > 1
        if not shard:
            return None
        if group is None:
            raise ValueError("shard=True needs a process group: the model's (OffloadModel(..., process_group=...)) "
                             "or process_group= here")
        if process_group is None and data_parallel is not None and data_parallel.host is not None:
            return cls(data_parallel.host)  # one worker issues all of the group's host collectives
        if "nccl" in str(dist.get_backend(group)).lower():
            raise ValueError(
                "the sharded update shares parameters between the ranks' host memory, which NCCL cannot reduce: "
                "pass process_group=torch.distributed.new_group(backend='gloo'), or shard=False to update "
                "everything on every rank")
        return cls(HostCollectives(engine_of(model).copies, group))

    def assign(self, ordered: dict[int, list[Item]], state: dict[Any, Any]) -> dict[int, list[Item]]:
        """Give each parameter of each slice (``ordered``: per slice, in memory order) an owner, and
        drop from ``state`` what other ranks own (its owner keeps it); per slice, the items this
        rank updates."""
        # A parameter keeps the owner an earlier plan gave it (a group added after some steps): its
        # state lives on that rank, and a new owner would start it over. Every rank made the same
        # earlier plans, so they agree on this one too.
        kept = {id(p): owner for params, slice_owners in self.shared.values() for p, owner in zip(params, slice_owners)}
        self.shared = {}
        owners_of = dict(zip(ordered, owners([[p for _, p, _ in items] for items in ordered.values()],
                                             self.collectives.world_size, kept)))
        # Compared with the other ranks' at the next update (compare_plan): a plan is also made for
        # reads that one rank may do alone (state_by_slice()), where a collective would wait for ever.
        self._made = [(index, [(k, g, owner) for (k, _, g), owner in zip(items, owners_of[index])])
                      for index, items in ordered.items()]
        mine = {}
        for index, items in ordered.items():
            slice_owners = owners_of[index]
            self.shared[index] = ([p for _, p, _ in items], slice_owners)
            for (_, p, _), owner in zip(items, slice_owners):
                if owner != self.collectives.rank:
                    state.pop(p, None)
            mine[index] = [item for item, owner in zip(items, slice_owners) if owner == self.collectives.rank]
        return mine

    def compare_plan(self) -> None:
        """Before updates start (in ``step()``, or the backward that starts them: every rank is
        there), raise on every rank when the ranks' plans differ (other parameter groups; a plain
        ``torch.optim`` optimizer on some): each would take parameters from owners that do not
        send them. One small object collective per plan that differs from the last compared (a
        plan made again as it was, after a load or a move, compares nothing); a plan is, per
        slice, per stepped parameter, its place in the slice, its group and its owner.

        Raises:
            ValueError: another rank's plan differs from this one.
            CollectiveError: some ranks did not join the comparison within the group's timeout.
        """
        group, world_size, plan = self.collectives.group, self.collectives.world_size, self._made
        if world_size == 1 or plan is None or plan == self._compared:
            return
        everyone: list[Any] = [None] * world_size
        try:
            dist.all_gather_object(everyone, plan, group=group)
        except RuntimeError as error:
            raise CollectiveError(
                f"comparing the sharded OffloadOptimizer's plan (which rank updates which parameter) with the other "
                f"ranks' failed on rank {self.collectives.rank} of {world_size}: {error}. Every rank must build an "
                "OffloadOptimizer over the same parameter groups (not a plain torch.optim optimizer on some ranks) "
                "and call step() and add_param_group() in the same order; or pass shard=False. A rank still in its "
                "backward's gradient averages when another reached step() waits here too: every rank must run the "
                "same synced backwards (no_sync() around the same ones)") from error
        for rank, theirs in enumerate(everyone):
            if theirs != plan:
                raise ValueError(
                    f"the sharded OffloadOptimizer of rank {rank} steps other parameters than rank "
                    f"{self.collectives.rank}'s ({_plan_difference(plan, theirs)}): every rank must pass the same "
                    "parameter groups, and add the same ones with add_param_group(); each rank updates its share of "
                    "them and takes the others from their owners")
        self._compared = plan

    def stepped(self, step: SliceStep) -> list[tuple[torch.Tensor, int]]:
        """The parameters of ``step``'s slice (every rank's) that have a gradient, each with the rank
        that owns it: what the exchange shares (none: the slice is not stepped)."""
        everyone, slice_owners = self.shared[step.index]
        return [(p, owner) for p, owner in zip(everyone, slice_owners) if p.grad is not None]

    def exchange(self, step: SliceStep, handed: Handed | None, told: Callable[[list[int]], None]) -> Event:
        """Once this rank's update of the parameters of ``step`` it owns (``handed``; ``None``: it
        owns none with a gradient) is done, every rank takes each updated parameter from its owner,
        then writes the slice's shadow; the event of that exchange, which the next forward's load
        waits for (``_hand_sharded`` in ``stepping.py`` queues and registers it).
        ``told`` gets the other ranks whose part did not finish (Note: [A failed part of a sharded
        update] in ``offload/streams/collectives.py``)."""
        stepped = self.stepped(step)
        storage = step.storage
        then = None
        if storage is not None and storage.shadow is not None:
            def then() -> None:  # every parameter is final now: write the whole shadow
                storage.write_shadow()
                storage.shadow_written()
        return self.collectives.broadcast([p.detach() for p, _ in stepped], [owner for _, owner in stepped],
                                          after=[None if handed is None else handed.event],
                                          what=f"sharing the updated parameters of slice {step.index}",
                                          then=then, failed=lambda: handed is not None and not handed.done, told=told)

    def refuse_partial(self, doing: str) -> None:
        """Raise when ``doing`` (``state_dict()``) would hand out this rank's share of the state as
        if it were the whole (Note: [A sharded state_dict()]); on one rank the share is the whole.

        Note: [A sharded state_dict()]
            Each rank keeps the state of the parameters it updates only, while ``param_groups``
            list every parameter. ``torch.optim``'s ``load_state_dict()`` takes a state that lacks
            some parameters without a word and starts them over (fresh Adam moments), so a share
            saved as the whole, by the habit ``if rank == 0: torch.save(optimizer.state_dict())``
            of a ``DistributedDataParallel`` run, resumes wrong in silence. ``state_dict()``
            therefore refuses, as ``ZeroRedundancyOptimizer.state_dict()`` does until it is
            consolidated; what needs the share (the gather of ``consolidated_state_dict()``)
            reads it with ``local_state_dict()`` in ``offload/optimizer.py``, and
            ``save_checkpoint`` never reads ``state_dict()``: each rank writes its share by name.

        Raises:
            RuntimeError: several ranks share the update.
        """
        rank, world_size = self.collectives.rank, self.collectives.world_size
        if world_size == 1:
            return
        raise RuntimeError(
            f"{doing} of a sharded OffloadOptimizer: rank {rank} of {world_size} keeps the optimizer state of only "
            f"the parameters it updates, while param_groups list every parameter, so a checkpoint of it would "
            f"restart the others with fresh state. Call optimizer.consolidated_state_dict(to=0) on every rank and "
            f"save what rank 0 gets (None on the others; it loads into optimizer_class and into an "
            f"OffloadOptimizer, sharded or not), or offload.save_checkpoint(path, model, optimizer) on every rank "
            f"(each rank writes its own share). OffloadOptimizer(..., shard=False) keeps the whole state on "
            f"every rank instead.")

    def gather_state(self, local: dict[str, Any], to: int) -> dict[str, Any] | None:
        """The whole state, merged from each rank's ``local`` share (``local_state_dict()`` in
        ``offload/optimizer.py``), on rank ``to`` of the group; ``None`` on the others. Every rank calls it."""
        group = self.collectives.group
        gathered: list[Any] | None = [None] * self.collectives.world_size if self.collectives.rank == to else None
        dist.gather_object(local["state"], gathered, dst=dist.get_global_rank(group, to), group=group)
        if gathered is None:
            return None
        merged: dict[int, Any] = {}
        for part in gathered:
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": local["param_groups"]}


def _plan_difference(mine: list[Any], theirs: list[Any]) -> str:
    """Where two plans of :meth:`Sharding.compare_plan` first differ, in words."""
    def text(plan: dict[int, Any], index: int) -> str:
        items = plan.get(index, [])
        groups = sorted({g for _, g, _ in items})
        return f"{len(items)} parameters" + (f" of groups {groups}" if items else "")
    mine_by, theirs_by = dict(mine), dict(theirs)
    index = next((i for i in sorted(set(mine_by) | set(theirs_by)) if mine_by.get(i) != theirs_by.get(i)), None)
    if index is None:
        return "the same parameters in another order"
    return f"in slice {index}: {text(theirs_by, index)} against {text(mine_by, index)} here"


def owners(slices: list[list[torch.Tensor]], world_size: int, kept: dict[int, int] | None = None) -> list[list[int]]:
    """Which rank updates each parameter of each slice (the same answer on every rank); a
    parameter in ``kept`` (by ``id``) keeps the rank given there.

    Slice by slice, each slice's parameters largest first, every parameter goes to the rank with
    the fewest elements so far, counted over the whole model: a rank takes a parameter only while
    no other has less, so no rank ends with more than ``1 / world_size`` of the elements plus the
    largest parameter. Counting per slice instead would hand rank 0 the largest parameter of every
    slice (nearly all of a model whose slices are one big weight each). Parameters are not split
    across ranks: an optimizer may treat a parameter as a whole (a norm over it, a factored
    second moment), and each rank's state stays a plain optimizer's, per whole parameter.

    Args:
        slices: per slice, its parameters that the optimizer steps.
        world_size: the number of ranks.
        kept: owners an earlier plan gave (``add_param_group`` after some steps: their state is
            on those ranks); the rest are placed around them as above, so the bound holds for
            what is placed anew.
    """
    kept = kept or {}
    load = [0] * world_size
    for params in slices:
        for p in params:
            if id(p) in kept:
                load[kept[id(p)]] += p.numel()
    chosen = [[kept.get(id(p), 0) for p in params] for params in slices]
    for params, mine in zip(slices, chosen):
        for k in sorted(range(len(params)), key=lambda k: (-params[k].numel(), k)):
            if id(params[k]) in kept:
                continue
            rank = min(range(world_size), key=lambda r: (load[r], r))
            mine[k] = rank
            load[rank] += params[k].numel()
    return chosen
