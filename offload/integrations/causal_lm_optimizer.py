"""The optimizer of an :class:`~offload.integrations.causal_lm.OffloadedCausalLM` under the Hugging Face
trainers: :func:`offload_optimizer`, which the class binds as its method, builds the
:class:`~offload.OffloadOptimizer` that ``transformers.Trainer`` would build from its arguments.

What it does not hold: the checks of the trainer's arguments it runs first (``transformers_refusals.py``),
and the optimizer itself (``offload/optimizer.py``).

Note: [An optimizer built before the trainer]
    ``optimizers=(model.offload_optimizer(args), None)`` builds the optimizer before the trainer's
    ``__init__`` runs, over the parameters the model holds then. A trainer that replaces some of
    them there leaves it stepping the old ones (Note: [Parameters replaced after the optimizer] in
    ``offload/optimizing/let_go.py``, which refuses that at the first ``step()``). TRL's ``SFTTrainer``
    does so for ``SFTConfig(chat_template_path=...)`` naming a tokenizer (a folder or a Hub id): it
    calls ``trl.clone_chat_template``, which adds the tokenizer's tokens and resizes the
    embeddings and ``lm_head``. A ``.jinja`` or ``.j2`` file only sets the tokenizer's template.
    :func:`offload_optimizer` refuses the first up front, with the two orders that work.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..optimizer import OffloadOptimizer
from .transformers_refusals import refuse_trainer_arguments, refuse_update_in_backward

__all__ = ["offload_optimizer"]


def offload_optimizer(model: Any, args: Any, **options: Any) -> OffloadOptimizer:
    """The optimizer ``transformers.Trainer`` would build from ``args`` (a ``TrainingArguments``,
    ``SFTConfig`` included), as an :class:`~offload.OffloadOptimizer` that steps the host copies
    beside the next forward: the same class and hyperparameters (``optim``, ``learning_rate``,
    the Adam betas and epsilon, ``fused`` for ``adamw_torch_fused``, the default) and the same
    two groups, ``weight_decay`` for the parameters the Trainer decays and none for biases and
    norms. Hand it to the trainer with ``optimizers=(optimizer, None)``: the trainer then builds
    its learning-rate schedule (warm-up included) over it. ``model`` is the ``OffloadedCausalLM``
    (``model.offload_optimizer(args)``).

    Args:
        args: the trainer's arguments.
        options: :class:`~offload.OffloadOptimizer`'s own (``num_threads``, ``disk_tier``).

    Raises:
        ValueError: an ``optim`` the Trainer builds from the model itself (GaLore, LOMO, ...), which
            cannot step slice by slice; ``update_in_backward``; an ``SFTConfig`` whose
            ``chat_template_path`` resizes the embeddings inside the trainer (Note: [An optimizer
            built before the trainer]); ``args`` this model cannot train under
            (:func:`~.transformers_refusals.refuse_trainer_arguments`).
    """
    from transformers import Trainer

    refuse_update_in_backward(options)
    refuse_trainer_arguments(model, args)
    _refuse_cloned_chat_template(args)

    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)) or {
            "params", "model", "optimizer_dict"} & set(kwargs):
        raise ValueError(f"optim={args.optim!r} builds its optimizer from the whole model; OffloadOptimizer "
                         "steps one slice at a time. Use an optimizer such as adamw_torch_fused (the default)")
    optimizer = OffloadOptimizer(model.offloaded, optimizer_class, _decay_groups(model, args.weight_decay),
                                 **options, **kwargs)
    if "bitsandbytes" in str(optimizer_class) and kwargs.get("optim_bits") == 8:
        _embeddings_in_32_bits(model)
    return optimizer


def _refuse_cloned_chat_template(args: Any) -> None:
    """Raise for a ``chat_template_path`` that TRL's ``SFTTrainer`` clones, resizing the embeddings
    after this optimizer is built (Note: [An optimizer built before the trainer])."""
    path = getattr(args, "chat_template_path", None)
    if path is None or (os.path.isfile(path) and path.endswith((".jinja", ".j2"))):
        return
    raise ValueError(
        f"{type(args).__name__}(chat_template_path={path!r}) names a tokenizer: TRL's trainer clones its chat "
        "template with trl.clone_chat_template, which adds its tokens and resizes the model's embeddings and lm_head "
        "inside the trainer's __init__, after this optimizer was built: it would keep stepping the old tensors. "
        "Either build the trainer with optimizers=(None, None) (the trainer builds its own optimizer after the "
        "resize), or call model, tokenizer, _ = trl.clone_chat_template(model, tokenizer, path) yourself, leave "
        "chat_template_path unset, and build model.offload_optimizer(args) after it")


def _embeddings_in_32_bits(model: Any) -> None:
    """What ``Trainer.create_optimizer`` does for a bitsandbytes 8-bit ``optim``: every embedding's
    weight keeps 32-bit state, through bitsandbytes' module overrides (which the inner optimizers
    read for their proxies, Note: [bitsandbytes overrides] in ``offload/optimizing/plan.py``)."""
    import bitsandbytes

    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


def _decay_groups(model: Any, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in the Trainer's two groups: ``weight_decay`` for those it decays, none
    for biases and norms. An empty group is kept, as the Trainer keeps it (LoRA adapters alone leave
    the second one empty): the two optimizers' state dicts then load into each other."""
    from transformers import Trainer

    # Trainer.get_decay_parameter_names reads nothing of the trainer: the rule is the Trainer's own.
    decayed = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for name, p in named if name in decayed], "weight_decay": weight_decay},
            {"params": [p for name, p in named if name not in decayed], "weight_decay": 0.0}]
