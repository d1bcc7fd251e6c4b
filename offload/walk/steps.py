"""How many times an OffloadOptimizer stepped each engine's parameters: what a backward compares
with its forward's count. What it does not hold: the step itself (``offload/optimizer.py``) or
the check of the parameters' own version counters (``CallRecord.check_versions`` in
``offload/autograd/records.py``).

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
    2. A forward records the count (``CallRecord.of``); its backward raises PyTorch's error, saying
       a step ran in between, where the count moved. Fused classes are caught too: the library
       knows it stepped them, although a plain fused optimizer leaves no trace PyTorch can see.
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


def steps_of(engine: Engine) -> int:
    """How many steps updated ``engine``'s parameters so far (rule 2 of Note: [A step between a
    forward and its backward])."""
    return _steps.get(engine, 0)


def count_step(engine: Engine, param_groups: Iterable[dict[str, Any]], started: Collection[int]) -> None:
    """Count a step of ``engine``'s parameters if it updates any: a parameter of ``param_groups``
    has a gradient, or backward ``started`` updates (rule 1 of Note: [A step between a forward
    and its backward]). The first parameter with a gradient ends the search."""
    if started or any(p.grad is not None for group in param_groups for p in group["params"]):
        _steps[engine] = _steps.get(engine, 0) + 1
