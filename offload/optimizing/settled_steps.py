"""Another optimizer's step over an OffloadModel's parameters waits for the model's pending host
updates first. What it does not hold: the updates (``offload/streams/updates.py``) or the reads
through the model that wait for them as well (``offload/modeling/settled.py``).

Note: [Another optimizer stepping the model's parameters]
    ``OffloadOptimizer.step()`` returns while the host worker still updates the slices (Note:
    [Overlapped host update] in ``offload/optimizer.py``). A second, plain ``torch.optim``
    optimizer over the same parameters (one kept from before the OffloadOptimizer, or one over
    weights it shares) holds them directly, not through the model, so nothing made its step wait:
    it read and wrote the parameters (and their ``.grad``) while the worker was still writing them,
    and the result changed from run to run. In plain PyTorch the two updates apply one after the
    other.

    1. A global step pre-hook (installed with the per-tensor warning's, when the first
       OffloadModel is built) waits, before such a step, for the pending updates of every engine
       that holds one of its parameters, as a read through the model does: ``wait_all`` with the
       shadows expired, since the step writes the host copies next.
    2. Cheap when nothing is pending, which is every step of a plain optimizer alone: one
       ``pending()`` per live engine, and the parameters are looked at only when one has updates
       pending.
    3. An OffloadOptimizer's own step, and its inner optimizers' (they run on the worker, over
       proxies), are not waited for here: the first orders its updates itself, the second would
       wait for itself.
"""

from __future__ import annotations

from typing import Any

import torch

from ..walk.engine import live_engines


def settle_before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The step pre-hook of Note: [Another optimizer stepping the model's parameters]."""
    # The flags first: an inner optimizer steps on the worker, which must not look at the engines.
    if getattr(optimizer, "_offload_inner", False) or getattr(optimizer, "_offload_outer", False):
        return
    pending = [engine for engine in live_engines() if engine.updates.pending()]
    if not pending:
        return
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for engine in pending:
        if not ids.isdisjoint(engine.parameter_ids):
            engine.updates.wait_all(shadows_stale=True)
