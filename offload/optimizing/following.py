"""An ``OffloadOptimizer`` following its model to another compute device: what ties it to the
model's engine, and re-tying it to the engine a move builds (rule 3 of Note: [Moving an
OffloadModel] in ``offload/modeling/placement.py``). What it does not hold: deciding whether a
move may happen (``placement.py``) or building the new engine (``offload/model.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..tiers.slice_update import held_state
from .stepping import SliceUpdates
from .tier_plumbing import TierPlumbing

if TYPE_CHECKING:
    from ..walk.engine import Engine


def tied_to_engine(optimizer: Any) -> list[str]:
    """Why ``optimizer`` (an ``OffloadOptimizer``, whose module imports this one) cannot follow its model to another compute device; none when it can."""
    reasons = []
    if optimizer._tier is not None:
        reasons.append("an OffloadOptimizer keeps its state on disk (disk_tier: files and workers of this "
                       "engine); build the OffloadOptimizer after moving the model")
    if optimizer._sharding is not None:
        reasons.append("an OffloadOptimizer shards its update over a process group; build the OffloadOptimizer "
                       "after moving the model")
    return reasons


def follow(optimizer: Any, engine: Engine) -> None:
    """Let ``optimizer`` step ``engine`` from now on: the model's engine, built anew for another
    compute device after every pending update (:func:`tied_to_engine` said none holds this back).
    The state stays as it is, keyed by the same parameters (the host's is exact as it was); a
    resident slice's moves beside its parameters. The plan and the update worker are built anew at
    the next step: the old ones point at the old host copies and copy streams."""
    optimizer._updates.close()
    failure = optimizer._updates.failure  # a mix an update left is the state's, wherever it is stepped
    optimizer._disk = TierPlumbing(None, engine.copies)
    optimizer._updates = SliceUpdates(engine, optimizer._disk, None, optimizer.num_threads)
    optimizer._updates.failure = failure
    engine.optimizers.add(optimizer)
    if optimizer._in_backward is not None:
        optimizer._in_backward.follow(engine, optimizer._updates)
    if optimizer._norms is not None:
        optimizer._norms.follow(engine)
    if optimizer._scaling is not None:
        optimizer._scaling.forget()  # the old engine's events, all run: not kept alive by them
    _state_beside_resident_parameters(optimizer, engine)
    optimizer._plan_key, optimizer._steps, optimizer._rest = None, [], []
    optimizer._stepped_engine = False


def _state_beside_resident_parameters(optimizer: Any, engine: Engine) -> None:
    """Move the state of the resident slices' parameters (Note: [Resident slices]), which went
    with the compute device, beside them, as ``torch.optim``'s ``load_state_dict()`` places state:
    each tensor on its parameter's device, ``step`` only under ``fused`` or ``capturable`` (on the
    CPU otherwise). Values and dtypes are kept: the copy is exact."""
    resident = {id(e.tensor) for s in engine.slices if s.storage.resident for e in s.storage.params}
    state = held_state(optimizer)
    for group in optimizer.param_groups:
        steps_beside = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            for key, value in (state.get(p, {}) if id(p) in resident else {}).items():
                if isinstance(value, torch.Tensor) and value.device != p.device and (key != "step" or steps_beside):
                    state[p][key] = value.to(p.device)
