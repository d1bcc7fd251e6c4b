"""A warning, once per process, when a plain optimizer steps OffloadModel parameters the slow way.

For CPU tensors PyTorch's optimizers default to their per-tensor implementation; on the host
parameters of an offloaded model that is 3-10x slower than ``fused=True`` (measured: issue 10's
table, and ``scripts/bench_optimizer.py``), and the host update is then the longest part of a
training step. A global optimizer step pre-hook notices it.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

#: Every parameter an OffloadModel holds, by id (weakly: models may be dropped). Not a WeakSet:
#: its membership test compares tensors with ``==``.
_offloaded: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def register(parameters: list[torch.Tensor]) -> None:
    """Remember parameters that an OffloadModel holds."""
    for p in parameters:
        _offloaded[id(p)] = p


def is_offloaded(p: torch.Tensor) -> bool:
    return _offloaded.get(id(p)) is p

_state = {"installed": False, "warned": False}


def install() -> None:
    """Register the hook, once (called when the first OffloadModel is built)."""
    if not _state["installed"]:
        register_optimizer_step_pre_hook(_hook)
        _state["installed"] = True


def _hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _state["warned"] or getattr(optimizer, "_offload_inner", False) or getattr(optimizer, "_offload_outer", False):
        return
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("foreach"):
            continue
        if any(is_offloaded(p) for p in group["params"]):
            _state["warned"] = True
            name = type(optimizer).__name__
            warnings.warn(
                f"{name} is stepping OffloadModel's host parameters with its per-tensor CPU implementation "
                "(PyTorch's default for CPU tensors), 3-10x slower than fused=True. Use "
                f"offload.OffloadOptimizer(model, torch.optim.{name}, ..., fused=True), which also overlaps the "
                "update with the next forward, or pass fused=True (or foreach=True).",
                stacklevel=3,
            )
            return
