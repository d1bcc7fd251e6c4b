"""What ``OffloadOptimizer`` checks of its own arguments, and which OffloadModel it steps when given a
wrapper of one. What it does not hold: the checks of ``update_in_backward`` and its companions
(``in_backward.py``), or those the optimizer class makes of its own arguments (it is built once to make them).
"""

from __future__ import annotations

import numbers
import os
from typing import Any

import torch

from ..model import OffloadModel
from ..tiers.disk_tier import DiskTier


def offload_model_of(model: Any) -> Any:
    """The OffloadModel that ``OffloadOptimizer(model, ...)`` steps: ``model`` itself, or the one a
    wrapper holds when the wrapper's parameters are exactly that model's: as ``model.offloaded``
    (``OffloadedCausalLM``), or as ``model.module``, itself or held by it (Lightning Fabric's
    ``_FabricModule``, which ``fabric.setup_module`` returns, and ``DistributedDataParallel``).
    Recognised by those attributes, so that ``import offload`` needs neither transformers nor
    Lightning. Anything else is returned as it is, for :func:`check_arguments` to refuse."""
    if isinstance(model, OffloadModel):
        return model
    inner = getattr(model, "offloaded", None)
    wrapped = getattr(model, "module", None)
    if inner is None and isinstance(wrapped, torch.nn.Module) and wrapped is not model:
        inner = offload_model_of(wrapped)
    if isinstance(inner, OffloadModel) and isinstance(model, torch.nn.Module) and (
            {id(p) for p in model.parameters()} == {id(p) for p in inner.parameters()}):
        return inner
    return model


def _stray_parameters(model: Any) -> str:
    """What to add to the refusal of a wrapper of an OffloadModel that holds parameters beside it
    (set on the wrapper, or registered on it behind its back), which ``offload_model_of`` would not
    step; empty for anything else."""
    inner = getattr(model, "offloaded", None)
    if not (isinstance(inner, OffloadModel) and isinstance(model, torch.nn.Module)):
        return ""
    held = {id(p) for p in inner.parameters()}
    stray = [name for name, p in model.named_parameters() if id(p) not in held]
    if not stray:
        return ""
    return (f", all of it: this {type(model).__name__} holds an OffloadModel (.offloaded) and also "
            f"{', '.join(stray[:5])}{' ...' if len(stray) > 5 else ''} outside it, which OffloadOptimizer would not "
            "step. Put them into the model before wrapping it (for an OffloadedCausalLM, whose forward never runs "
            "them, delete them, del model.<name>, and change the Hugging Face model: model.hf_model.lm_head = ..., "
            "which its stages follow), or pass model.offloaded to step the OffloadModel alone and give the others "
            "an optimizer of their own. Otherwise")


def check_arguments(model: Any, optimizer_class: Any, num_threads: Any, disk_tier: Any,
                    params: Any = None) -> OffloadModel:
    """Raise what ``OffloadOptimizer`` says it raises for its own arguments; return the OffloadModel it steps."""
    model = offload_model_of(model)
    if not isinstance(model, OffloadModel):
        raise TypeError(
            f"OffloadOptimizer steps an OffloadModel or an OffloadedCausalLM, got {type(model).__name__}; wrap the "
            f"model first{_stray_parameters(model)}: model = OffloadModel(model, device=...) (a Hugging Face "
            f"causal LM: model = OffloadedCausalLM(model, device=...)), then OffloadOptimizer(model, "
            f"torch.optim.AdamW, lr=...)")
    if isinstance(optimizer_class, torch.optim.Optimizer):
        # Its repr would list every hyperparameter of every group.
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got a {type(optimizer_class).__name__} "
            f"instance; pass the class and its arguments: OffloadOptimizer(model, "
            f"torch.optim.{type(optimizer_class).__name__}, lr=...)")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, got "
            f"{optimizer_class!r}; pass its arguments as keywords: OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3)")
    if isinstance(params, numbers.Number):
        # torch.optim takes the learning rate second (AdamW(params, 1e-3)); here the third place is params,
        # and the class would fail with "'float' object is not iterable".
        raise TypeError(
            f"params (OffloadOptimizer's third argument) is {params!r}, a number: pass hyperparameters as "
            f"keywords, OffloadOptimizer(model, torch.optim.{optimizer_class.__name__}, lr={params!r})")
    if issubclass(optimizer_class, torch.optim.LBFGS):
        raise ValueError("LBFGS re-evaluates the model inside step() through a closure; OffloadOptimizer "
                         "cannot overlap that. Use it directly on model.parameters().")
    if callable(getattr(optimizer_class, "train", None)) or callable(getattr(optimizer_class, "eval", None)):
        # torch.optim.Optimizer has neither: schedule-free optimizers switch the parameters between two
        # points with them, which per-slice optimizers stepping beside the forward cannot follow.
        name = optimizer_class.__name__
        raise ValueError(
            f"{name} has train() and eval() of its own (a schedule-free optimizer): they move the parameters "
            "between two points, and it keeps its counters in the parameter groups; OffloadOptimizer's "
            f"updates, one slice at a time beside the next forward, follow neither. Step it on the model's "
            f"parameters directly, {name}(model.parameters(), ...) (the Hugging Face Trainer does so, and calls "
            "its train() and eval(), with optimizers=(None, None)), or use another optimizer")
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or num_threads < 1):
        raise ValueError(f"num_threads must be a positive int or None, got {num_threads!r}")
    if disk_tier is not None and not isinstance(disk_tier, (DiskTier, str, os.PathLike)):
        raise TypeError(f"disk_tier must be a DiskTier or a directory path, got {type(disk_tier).__name__}")
    return model
