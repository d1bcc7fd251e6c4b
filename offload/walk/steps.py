"""How many times an OffloadOptimizer stepped each engine's parameters, and which parameters each
step updated: what a backward compares with its forward's record. What it does not hold: the step
itself (``offload/optimizer.py``) or the check of the parameters' own version counters
(``CallRecord.check_versions`` in ``offload/autograd/records.py``).

Note: [A step between a forward and its backward]
    Plain PyTorch catches ``optimizer.step()`` run between a forward and its backward: the step
    bumps the version counter of each parameter it updates, and backward refuses a saved tensor
    whose version moved ("modified by an inplace operation"). Under an OffloadOptimizer no counter
    moves: its inner optimizers step proxies that share the parameters' memory but count versions
    of their own (``offload/optimizing/plan.py``), and the update runs later, on the host worker.
    Backward would then recompute each slice from the updated host copies: gradients of
    parameters the forward never used, silently.

    1. ``step()`` counts a step of the engine here, on the calling thread, before it starts any
       update, whenever it updates something: a parameter with a gradient, or an update that
       backward started (``update_in_backward``). A step that finds no gradient changes nothing
       and counts nothing, as ``torch.optim`` bumps no counter then.
    2. A forward records the count and the tensors it read in the parameters' places
       (``CallRecord.of``); its backward raises PyTorch's error, saying a step ran in between, where
       a later step updated one of them. A step that updated only others (parameters outside the
       model the optimizer also steps, or the model's own under a forward that read the tensors
       ``torch.func.functional_call`` put in their places: an EMA's weights) is no mistake. Fused
       classes are caught too: the library knows it stepped them, although a plain fused optimizer
       leaves no trace PyTorch can see.
    3. The parameters' own version counters are left as the inner optimizers leave them: the
       count tells a step from a write of the user's (which bumps a counter and keeps its own
       message), and the library's readers of ``_version`` see no write for a change the library
       made and accounts for itself.
    4. Updates that backward itself runs (``update_in_backward``) count nothing while it runs:
       the step that follows counts them, once that backward is done.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine

#: Engine to the number of steps an OffloadOptimizer took over its parameters; held weakly, so an
#: engine's count goes with it.
_steps: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()
#: Engine to {id of a parameter a step updated: the count after the last step that updated it}.
_last: weakref.WeakKeyDictionary[Engine, dict[int, int]] = weakref.WeakKeyDictionary()


def steps_of(engine: Engine) -> int:
    """How many steps updated ``engine``'s parameters so far (rule 2 of Note: [A step between a
    forward and its backward])."""
    return _steps.get(engine, 0)


def read_by_forward(engine: Engine) -> frozenset[int]:
    """The ids of the tensors a forward reads in the parameters' places now: the model's own, or
    those ``torch.func.functional_call`` substituted for them (rule 2)."""
    return frozenset(id(entry.tensor) for s in engine.slices for entry in s.storage.params)


def stepped_since(engine: Engine, steps: int, read: Collection[int]) -> bool:
    """Whether a step after the ``steps``-th updated one of the tensors ``read`` (rule 2)."""
    last = _last.get(engine)
    return last is not None and steps != steps_of(engine) and any(last.get(i, 0) > steps for i in read)


def count_step(engine: Engine, param_groups: Iterable[dict[str, Any]], started: Collection[int]) -> None:
    """Count a step of ``engine``'s parameters if it updates any: each parameter of ``param_groups``
    with a gradient, and each of the slices whose update backward ``started`` (rule 1 of Note: [A
    step between a forward and its backward])."""
    stepped = [id(p) for group in param_groups for p in group["params"] if p.grad is not None]
    stepped += [id(entry.tensor) for s in engine.slices if s.index in started for entry in s.storage.params]
    if not stepped:
        return
    count = _steps[engine] = _steps.get(engine, 0) + 1
    last = _last.setdefault(engine, {})
    for i in stepped:
        last[i] = count
