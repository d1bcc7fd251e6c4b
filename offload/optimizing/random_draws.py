"""``RandomDraws``: whether an ``OffloadOptimizer``'s updates draw from PyTorch's default CPU
generator, and the updates of an optimizer that does run inside ``step()``, in the plain
optimizer's order. What it does not hold: the hand-off of the updates (``stepping.py``), or the
generator states a recompute replays (``offload/autograd/replay.py``).

Note: [An optimizer that draws random numbers]
    A plain optimizer that draws (SGLD's noise, stochastic rounding: torchao's
    ``AdamW8bit(bf16_stochastic_round=True)``) draws in ``step()``, between one step's backward and
    the next forward, each parameter's numbers in its groups' order. An overlapped update (Note:
    [Overlapped host update] in ``offload/optimizer.py``) draws on the update worker while the
    caller goes on: its draws land among the next forward's dropout masks, whose recompute then
    cannot draw them again, and inside a recompute's replay (``replaying_rng``), which they move;
    backward differentiates another function than the loss's, differently from run to run. So:

    1. PyTorch's own classes (``torch.optim``) draw nothing: their updates are overlapped from the
       first step. For any other class, until an update has been seen, ``step()`` waits for its updates (they run on the update
       worker, in slice order, as always) and compares ``torch.default_generator``'s state before
       and after (a 5 KB read, under a microsecond on a 2-core VM). The first ``step()`` that
       updates anything decides, once: an optimizer that does not draw costs that one wait (and
       an error of its first update is raised by that ``step()``), and is overlapped from its
       second step on.
    2. One seen drawing warns once and keeps running so: every ``step()`` returns once its updates
       are done, so their draws come where the plain optimizer's come in the caller's sequence,
       and the generator is where plain PyTorch leaves it. ``update_in_backward`` is switched off
       for it: its updates wait for ``step()``, after backward's own draws, as plain PyTorch draws.
       The overlap is lost; an optimizer that takes a ``torch.Generator`` of its own keeps it.
    3. The order: the inner optimizers draw slice after slice, each its groups' parameters in
       order; the parameters outside the model go first or last, where the plain optimizer's
       groups list them (their update is then handed over once the slices' are done). Where no
       such order is the plain one (groups that interleave the slices, as weight-decay groups
       over every layer do), each parameter's numbers are drawn from the same distribution as
       plainly but are other numbers: it warns that the results are not the plain optimizer's.
    4. Not seen: draws that begin after the first update (a noise schedule starting at step N),
       which an overlapped update cannot tell from the caller's own draws; and generators other
       than PyTorch's CPU one (Python's ``random``, NumPy's) drawn from in an update.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from ..tiers.slice_update import SliceStep
from .stepping import SliceUpdates

#: Starts updates of a step: the resident slices', then the streamed slices' and those of the
#: parameters outside the model, the slices given last handed over already in this step
#: (``SliceUpdates.run_now`` and ``submit`` with the step's arguments).
Start = Callable[[Sequence[SliceStep], Sequence[SliceStep], Sequence[SliceStep], Collection[int]], None]


class RandomDraws:
    """Whether an optimizer's updates draw from ``torch.default_generator`` (Note: [An optimizer
    that draws random numbers]): ``None`` until an update was seen.

    Args:
        optimizer_class: the class of the updates; PyTorch's own are known not to draw (rule 1).
    """

    def __init__(self, optimizer_class: type[torch.optim.Optimizer]) -> None:
        self.draws: bool | None = False if optimizer_class.__module__.startswith("torch.optim.") else None
        self._order: tuple[Any, bool | None] | None = None  # (plan key, what _outside_last says)

    def start(self, optimizer: Any, todo: Sequence[SliceStep], started: Collection[int], start: Start) -> None:
        """Start the updates ``todo`` (and those of the parameters outside the model; ``started``:
        the slices whose update backward started) with ``start``: overlapped once the optimizer is
        known not to draw, else in the plain order, and waited for."""
        resident = [s for s in todo if s.storage is not None and s.storage.resident]
        streamed = [s for s in todo if not (s.storage is not None and s.storage.resident)]
        rest = optimizer._rest
        if self.draws is False:
            start(resident, streamed, rest, started)
            return
        updates: SliceUpdates = optimizer._updates
        before = torch.default_generator.get_state() if self.draws is None else None
        if rest and optimizer._sharding is None and self._outside_last(optimizer, todo):
            start(resident, streamed, [], started)
            updates.engine.updates.finish_all()  # the slices' draws first, as plainly
            # The slices count as handed over in this step, should the next hand-off raise (rule 6
            # of Note: [An update that failed part way] in partial_failure.py).
            start([], [], rest, {*started, *(s.index for s in todo)})
        else:
            start(resident, streamed, rest, started)
        updates.engine.updates.finish_all()
        if before is not None and _any_gradient([*todo, *rest]):
            self.draws = not torch.equal(before, torch.default_generator.get_state())
            if self.draws:
                _drawing(optimizer, optimizer._sharding is not None or self._outside_last(optimizer, todo) is None)

    def _outside_last(self, optimizer: Any, todo: Sequence[SliceStep]) -> bool | None:
        """Whether the plain optimizer steps the parameters outside the model after the model's
        (``False``: before them; ``None``: no order of the updates is the plain one), per plan."""
        if self._order is None or self._order[0] != optimizer._plan_key:
            self._order = (optimizer._plan_key, _plain_position(optimizer, todo))
        return self._order[1]


def _plain_position(optimizer: Any, todo: Sequence[SliceStep]) -> bool | None:
    plain = [id(p) for group in optimizer.param_groups for p in group["params"]]
    slices = [i for step in todo for i in _drawn_order(step)]
    outside = [i for step in optimizer._rest for i in _drawn_order(step)]
    if slices + outside == plain:
        return True
    return False if outside + slices == plain else None


def _drawn_order(step: SliceStep) -> list[int]:
    """The user's parameters ``step`` steps, by id, in the order its inner optimizer steps them."""
    if step.whole is None:
        return []
    user = {id(proxy): p for proxy, p in zip(step.whole.proxies, step.whole.params)}
    return [id(user[id(proxy)]) for group in step.whole.optimizer.param_groups for proxy in group["params"]]


def _any_gradient(steps: Sequence[SliceStep]) -> bool:
    return any(p.grad is not None for s in steps if s.whole is not None for p in s.whole.params)


def _drawing(optimizer: Any, out_of_order: bool) -> None:
    """The optimizer was seen drawing: say so once, and start no update in backward from now on."""
    backward = optimizer._in_backward
    if backward is not None:
        optimizer._updates.engine.milestones.unsubscribe(backward)
        optimizer._in_backward = None
    order = (" It steps the parameters in another order than the plain optimizer (parameter groups that interleave "
             "the model's slices, or sharded), so each parameter's numbers are not the plain optimizer's (the same "
             "distribution, other values): with one group, or groups that each hold whole slices in model order, "
             "they are." if out_of_order else "")
    warnings.warn(
        f"OffloadOptimizer: {optimizer.optimizer_class.__name__}'s update draws random numbers from PyTorch's default "
        f"generator, so its updates now run inside step(), which returns once they are done (and not in backward: "
        f"update_in_backward is off for it), to draw what the plain optimizer draws.{order} To keep the update "
        f"overlapped with the next forward, give the optimizer a torch.Generator of its own if it takes one.",
        stacklevel=3)
