"""How an ``OffloadOptimizer`` is deep-copied and pickled: rebuilt over its model's copy from its
settings and its ``state_dict()``, never copied field by field (its worker threads, its
subscriptions to the model's walks and its disk tier's files are not the copy's to share). What it
does not hold: the optimizer (``offload/optimizer.py``) or how its model is copied
(``offload/modeling/copying.py``).

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
"""

from __future__ import annotations

from typing import Any

import torch

from ..tiers.disk_tier import DiskTier

_DO_INSTEAD = ("save optimizer.state_dict() (or the model and the optimizer with offload.save_checkpoint), then "
               "build OffloadOptimizer(model_copy, ...) for the model's copy and load_state_dict() it")


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
        backward = optimizer._in_backward
        if backward is not None and backward.started:
            raise RuntimeError("update_in_backward: backward started this step's updates, and a copy made before "
                               "step() would update those slices twice; call step() first, then copy the optimizer")
        state_dict = optimizer.state_dict()  # after the pending updates; a failed one raises here
        names = {id(p): name for name, p in optimizer.model.named_parameters()}
        groups = [{**group, "params": [names.get(id(p), p) for p in group["params"]]}
                  for group in optimizer.param_groups]
        return _rebuilt, (type(optimizer), optimizer.model, optimizer.optimizer_class, groups, _settings(optimizer),
                          state_dict)

    def __copy__(self) -> Any:
        # A shallow copy would share the model, and only the newest optimizer of a model steps it:
        # the original would stop stepping.
        raise TypeError(f"copy.copy() of an OffloadOptimizer would be a second optimizer over the same model, and "
                        f"only one optimizer steps a model; copy the model and the optimizer together with "
                        f"copy.deepcopy((model, optimizer)), or {_DO_INSTEAD}")


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
             settings: dict[str, Any], state_dict: dict[str, Any]) -> torch.optim.Optimizer:
    """The copy: a ``cls`` (``OffloadOptimizer``) of ``optimizer_class`` over ``model`` (the
    model's copy), each parameter ``groups`` names found in it by name, loaded with ``state_dict``."""
    params = dict(model.named_parameters())
    groups = [{**group, "params": [params[p] if isinstance(p, str) else p for p in group["params"]]}
              for group in groups]
    optimizer = cls(model, optimizer_class, groups, **settings)
    optimizer.load_state_dict(state_dict)
    return optimizer
