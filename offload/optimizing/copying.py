"""How an ``OffloadOptimizer`` is deep-copied and pickled: rebuilt over its model's copy from its
settings and its ``state_dict()``, never copied field by field (its worker threads, its
subscriptions to the model's walks and its disk tier's files are not the copy's to share); and
the refusal a copy shares with ``state_dict()`` and ``save_checkpoint`` between a backward that
started updates and ``step()`` (:func:`check_step_finished`). What it does not hold: the optimizer
(``offload/optimizer.py``) or how its model is copied (``offload/modeling/copying.py``).

Note: [Copying an OffloadOptimizer]
    1. ``copy.deepcopy`` and pickling (``torch.save(optimizer)``) take the model, the settings, the
       groups (a parameter of the model by its name, any other as itself) and ``state_dict()``,
       after the pending updates. The model is copied with them: in one deep copy or one pickle
       with the model (``copy.deepcopy((model, optimizer))``, ``torch.save({"model": model,
       "optimizer": optimizer})``) the copy steps the model's copy; copied alone, it steps a copy of
       the model of its own (``copy.model``), as a ``torch.optim`` optimizer's copy steps copies of
       its parameters.
    2. The copy is ``OffloadOptimizer(model_copy, ...)`` with the same settings, loaded with the
       state: it steps bit for bit as a fresh optimizer loaded with ``state_dict()``. Its host
       worker and its disk tier (a directory of its own beside the original's) are its own; what a
       ``torch.optim`` optimizer's copy drops (hooks, a scheduler's wrapper of ``step``) it drops.
    3. The original is left as it was, and keeps stepping: the copy's state is copied, never shared.
    4. Refused at copy time, saying what to do: ``copy.copy`` (a second optimizer over the same
       model: only the newest steps it), a sharded optimizer (it holds only this rank's share of
       the state), and one whose backward started updates that ``step()`` has not finished (the
       copy would update those slices twice).
    5. That last moment is refused by ``state_dict()`` and ``save_checkpoint`` too, through the
       same check (:func:`check_step_finished`): the slices backward updated are a step ahead of
       those that wait for ``step()`` (Note: [Update in backward] in ``in_backward.py``), of the
       parameters outside the model and of the loop's own count and scheduler, so what they would
       hand out mixes two steps. ``step()`` finishes the step with the gradients backward read
       (``zero_grad()`` is refused there): call it first. A backward that raised once updates had
       started is left to ``check_whole`` (``offload/optimizer.py``), which latches that mix and
       refuses it with its own advice, to load the last checkpoint (``step()`` would raise); a
       copy, which reads ``state_dict()``, is refused by it then too.
    6. A parameter the model let go of after the optimizer was built (Note: [Parameters replaced
       after the optimizer] in ``let_go.py``) is copied as itself, and its note with it: the copy
       refuses to step it as the original does, with the same advice.
"""

from __future__ import annotations

from typing import Any

import torch

from ..tiers.disk_tier import DiskTier
from .let_go import carry_let_go, noted_let_go

_DO_INSTEAD = ("save optimizer.state_dict() (or the model and the optimizer with offload.save_checkpoint), then "
               "build OffloadOptimizer(model_copy, ...) for the model's copy and load_state_dict() it")

#: Why ``state_dict()`` and a save are refused between a backward that started updates and
#: ``step()`` (Note: [Copying an OffloadOptimizer], rule 5).
HALF_A_STEP = ("what it holds would mix two steps: the slices updated are a step ahead of what step() still "
               "does (the slices that wait for it, the parameters outside the model) and of the loop's own step "
               "count and scheduler")


class CopiedByStateDict:
    """The base of ``OffloadOptimizer`` for ``copy.deepcopy``, ``copy.copy`` and pickling
    (``torch.save(optimizer)``): a deep copy or a loaded pickle is built anew over the model's copy
    and loaded with ``state_dict()``; a shallow copy is refused (Note: [Copying an OffloadOptimizer])."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Rebuild it with :func:`_rebuilt` from the model, the settings, the groups and the state.

        Raises:
            TypeError: the optimizer is sharded.
            RuntimeError: backward started updates that ``step()`` has not finished; or what
                ``state_dict()`` raises (an update that failed).
        """
        optimizer: Any = self
        if optimizer._sharding is not None:
            raise TypeError(f"a sharded OffloadOptimizer holds only this rank's share of the state and cannot be "
                            f"copied or pickled; gather it with consolidated_state_dict() instead, or {_DO_INSTEAD}")
        check_step_finished(optimizer, "copy the optimizer",
                            "a copy made before step() would update those slices twice")
        state_dict = optimizer.state_dict()  # after the pending updates; a failed one raises here
        names = {id(p): name for name, p in optimizer.model.named_parameters()}
        groups = [{**group, "params": [names.get(id(p), p) for p in group["params"]]}
                  for group in optimizer.param_groups]
        # A tensor the model let go of is copied as itself, outside the model's copy: its note goes
        # with it, so the copy refuses to step it too (rule 6).
        let_go = {(g, i): name for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])
                  if id(p) not in names and (name := noted_let_go(optimizer, p)) is not None}
        return _rebuilt, (type(optimizer), optimizer.model, optimizer.optimizer_class, groups, _settings(optimizer),
                          state_dict, let_go)

    def __copy__(self) -> Any:
        # A shallow copy would share the model, and only the newest optimizer of a model steps it:
        # the original would stop stepping.
        raise TypeError(f"copy.copy() of an OffloadOptimizer would be a second optimizer over the same model, and "
                        f"only one optimizer steps a model; copy the model and the optimizer together with "
                        f"copy.deepcopy((model, optimizer)), or {_DO_INSTEAD}")


def check_step_finished(optimizer: Any, doing: str, because: str) -> None:
    """Refuse ``doing`` between the backward that started this step's updates (``update_in_backward``)
    and the ``step()`` that finishes the step: the one check of that moment, for a copy,
    ``state_dict()`` and ``save_checkpoint`` (Note: [Copying an OffloadOptimizer], rule 5).

    Args:
        optimizer: the ``OffloadOptimizer``.
        doing: what is refused, as the advice ends ("call step() first, then ``doing``").
        because: why, for the message.

    Raises:
        RuntimeError: backward started updates and ``step()`` has not come; the message names the
            slices updated and those that wait for ``step()``, and why each waits.
    """
    backward = optimizer._in_backward
    # A backward that raised once it had started updates (no forward since: still open; or one
    # since: failed) left a mix that check_whole (offload/optimizer.py) refuses with its own
    # advice, to load the last checkpoint: a step() would raise there.
    if backward is None or not backward.started or backward._task_open or backward._failed:
        return
    waiting = "; ".join(f"slice {index} waits for step(): {why}" for index, why in sorted(backward.deferred.items()))
    raise RuntimeError(f"update_in_backward: backward started this step's updates (slices {sorted(backward.started)} "
                       f"are updated{f'; {waiting}' if waiting else ''}), and step() has not finished the step: "
                       f"{because}; call step() first, then {doing}")


def _settings(optimizer: Any) -> dict[str, Any]:
    """The keyword arguments ``OffloadOptimizer`` was built with, for a copy that is local (never sharded)."""
    backward, norms, tier = optimizer._in_backward, optimizer._norms, optimizer._tier
    accumulating = backward if backward is not None else norms  # what counts the backwards
    return {**optimizer.optimizer_kwargs, "num_threads": optimizer.num_threads, "shard": False,
            # Each optimizer makes a fresh directory in the tier's path: the copy's files are its own.
            "disk_tier": None if tier is None else DiskTier(tier.directory.parent, keep=tier.keep, direct=tier.direct),
            "update_in_backward": backward is not None, "norms_in_backward": norms is not None,
            "accumulation_steps": 1 if accumulating is None else accumulating.accumulation_steps,
            "scale_in_update": optimizer._scaling is not None}


def _rebuilt(cls: type[Any], model: Any, optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]],
             settings: dict[str, Any], state_dict: dict[str, Any],
             let_go: dict[tuple[int, int], str] | None = None) -> torch.optim.Optimizer:
    """The copy: a ``cls`` (``OffloadOptimizer``) of ``optimizer_class`` over ``model`` (the
    model's copy), each parameter ``groups`` names found in it by name, loaded with ``state_dict``;
    the parameters at ``let_go``'s places (group, index) noted as let go under its names (rule 6;
    absent in a pickle from before)."""
    params = dict(model.named_parameters())
    groups = [{**group, "params": [params[p] if isinstance(p, str) else p for p in group["params"]]}
              for group in groups]
    optimizer = cls(model, optimizer_class, groups, **settings)
    for (g, i), name in (let_go or {}).items():
        carry_let_go(optimizer, groups[g]["params"][i], name)
    optimizer.load_state_dict(state_dict)
    return optimizer
