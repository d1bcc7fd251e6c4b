"""What a save and a load see through: a training framework's wrappers of the model and the optimizer.

Lightning Fabric's ``fabric.setup`` returns a ``_FabricModule`` around the model and a
``_FabricOptimizer`` around the optimizer, and those are what a Fabric loop holds. Taken as they are,
a checkpoint would record the optimizer's class as Fabric's generated ``FabricAdamW`` (so that a
plain ``AdamW`` refuses it), name the parameters ``_forward_module.<name>`` (so that only another
Fabric module has them), and see no OffloadModel behind the module. Seen through, a checkpoint
saved from Fabric's objects is the one the objects they wrap would have saved: it loads into the
plain model and optimizer and into an OffloadModel and OffloadOptimizer, and one of those loads
into Fabric's objects. The wrappers are recognised by their shape, so that ``import offload``
needs no Lightning. What it does not hold: how an OffloadOptimizer's own methods see through
Fabric's optimizer (:func:`~offload.tiers.slice_update.unwrapped_optimizer`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..tiers.slice_update import unwrapped_optimizer


def unwrapped_module(model: Any) -> Any:
    """``model``, or the module a Fabric ``_FabricModule`` wraps: the one given to ``fabric.setup``
    (its ``module``, not the ``_forward_module`` a strategy made of it, such as torch's
    ``DistributedDataParallel``), whose ``state_dict()`` the wrapper hands out as its own."""
    while isinstance(model, nn.Module) and "_forward_module" in model._modules and (
            isinstance(wrapped := getattr(model, "module", None), nn.Module) and wrapped is not model):
        model = wrapped
    return model


def unwrapped(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """``model`` and ``optimizer`` with Fabric's wrappers (and Lightning's ``LightningOptimizer``)
    seen through; anything else as it is, for the checks of a save or a load to judge."""
    # Not an optimizer (a path given in its place): as it is, for the checks to name.
    kept = not isinstance(optimizer, torch.optim.Optimizer)
    return unwrapped_module(model), optimizer if kept else unwrapped_optimizer(optimizer)
