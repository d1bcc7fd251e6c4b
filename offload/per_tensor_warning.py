"""A warning, once per process, when an optimizer steps OffloadModel parameters the slow way.

For CPU tensors PyTorch's optimizers default to their per-tensor implementation; on the host
parameters of an offloaded model that is 4-7x slower than ``fused=True``, and ``foreach=True`` is
slower still (AdamW, ``benchmarks/bench_optimizer.py``: 4.3x and 6.6x, the table in
``docs/optimizer.md``), and the host update is then the longest part of a training step. A global optimizer step
pre-hook notices it, for plain optimizers and for ``OffloadOptimizer`` alike (which overlaps the
update, but still waits for about one slice's update of it); only optimizers that have a fused
implementation (a ``fused`` setting: Adam, AdamW, SGD, Adagrad) are warned about.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .optimizing.settled_steps import settle_before_step
from .walk.engine import held_by_an_engine


def is_offloaded(p: torch.Tensor) -> bool:
    """Whether an OffloadModel holds ``p``: the engines say so by id, holding no weak reference to
    it, which would stop ``torch.utils.swap_tensors``."""
    return held_by_an_engine(p)


_state = {"installed": False, "warned": False}


def install() -> None:
    """Register the hook, once (called when the first OffloadModel is built), and beside it the
    wait of another optimizer's step for the model's pending updates (Note: [Another optimizer
    stepping the model's parameters] in ``offload/optimizing/settled_steps.py``)."""
    if not _state["installed"]:
        register_optimizer_step_pre_hook(_hook)
        register_optimizer_step_pre_hook(settle_before_step)
        _state["installed"] = True


def _hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # Inner optimizers step proxies for an OffloadOptimizer, which is checked itself.
    if _state["warned"] or getattr(optimizer, "_offload_inner", False):
        return
    for group in optimizer.param_groups:
        if "fused" not in group or group["fused"]:
            continue
        if any(is_offloaded(p) for p in group["params"]):
            _state["warned"] = True
            outer = getattr(optimizer, "_offload_outer", False)
            cls = optimizer.optimizer_class if outer else type(optimizer)  # type: ignore[attr-defined]
            name = cls.__name__
            # As the user would write it: torch.optim.AdamW, or a subclass by its own module.
            spelled = f"torch.optim.{name}" if getattr(torch.optim, name, None) is cls else f"{cls.__module__}.{name}"
            how = "with foreach=True" if group.get("foreach") else \
                "with its per-tensor CPU implementation (PyTorch's default for CPU tensors)"
            fix = (f"Pass fused=True: OffloadOptimizer(model, {spelled}, ..., fused=True)." if outer else
                   f"Use offload.OffloadOptimizer(model, {spelled}, ..., fused=True), which also overlaps "
                   "the update with the next forward, or pass fused=True.")
            warnings.warn(
                f"{name} is stepping OffloadModel's host parameters {how}, 4-7x slower than fused=True on the host "
                f"(AdamW, measured by benchmarks/bench_optimizer.py: see docs/optimizer.md). {fix}",
                stacklevel=3,
            )
            return
