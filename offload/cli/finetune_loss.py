"""``offload-finetune``'s loss: the mean over a step's tokens, and a mixture of experts' load-balancing loss.

Note: [A router loss in the command]
    A mixture of experts whose family adds a load-balancing loss (Mixtral, Qwen3-MoE, OLMoE, ...:
    Note: [Router logits] in ``offload/integrations/transformers_router.py``) adds it when its
    config asks (``output_router_logits``, times ``router_aux_loss_coef``), as the model does under
    ``transformers.Trainer``; ``--router-aux-loss-coef`` asks with its own coefficient, or turns it
    off with 0 (:func:`router_coefficient`). Each batch's term is the family's loss over that
    batch's router logits, and a step's term is their mean over its ``--grad-accum`` batches, so
    the coefficient weighs it the same whatever the accumulation (``Trainer``'s summed losses weigh
    it ``gradient_accumulation_steps`` times). The evaluation reports the cross-entropy alone, the
    loss its perplexity is of.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..model import OffloadModel
from .finetune_args import fail

__all__ = ["batch_loss", "evaluate", "router_coefficient"]


def router_coefficient(args: argparse.Namespace, hf: Any) -> float | None:
    """The load-balancing loss's coefficient in the loss trained on, or ``None`` when it is left
    out (Note: [A router loss in the command]); exits for ``--router-aux-loss-coef`` on a model
    without one."""
    from ..integrations.transformers_router import router_loss_of

    router = router_loss_of(hf)
    if args.router_aux_loss_coef is not None:
        if router is None and args.router_aux_loss_coef:
            raise fail(f"--router-aux-loss-coef: {type(hf).__name__} adds no load-balancing loss of router logits "
                       "(a mixture of experts such as Mixtral, Qwen3-MoE or OLMoE does); leave it out")
        return args.router_aux_loss_coef or None
    config = hf.config.get_text_config()
    return router.coefficient if router is not None and getattr(config, "output_router_logits", False) else None


def batch_loss(args: argparse.Namespace, model: OffloadModel, hf, ids: torch.Tensor, tokens: int,
               router_coef: float | None = None) -> torch.Tensor:
    """The batch's share of a mean over ``tokens`` loss tokens (``num_items_in_batch``), and with
    ``router_coef`` its share of the step's load-balancing term (Note: [A router loss in the command])."""
    batch: dict[str, Any] = {"input_ids": ids}
    if args.loss_chunk_tokens:
        batch["labels"] = ids
    if router_coef is not None:
        batch["output_router_logits"] = True
    output = model(batch)
    if router_coef is not None:
        output, *router_logits = output
    if args.loss_chunk_tokens:
        loss = output.sum() / tokens
    else:
        loss = hf.loss_function(logits=output, labels=ids, vocab_size=hf.config.vocab_size,
                                num_items_in_batch=tokens)
    if router_coef is None:
        return loss
    from ..integrations.transformers_router import flat_router_logits, router_loss_of

    aux_loss = router_loss_of(hf)(flat_router_logits(router_logits), None)  # packed blocks: no padding to mask
    return loss + router_coef * aux_loss.to(loss.device) / args.grad_accum


def evaluate(args: argparse.Namespace, model: OffloadModel, hf, batches: list[torch.Tensor]) -> float:
    """The mean loss over every token of the evaluation batches, in eval mode and without gradients."""
    from ..integrations.transformers import CausalLMSequential

    tokens = sum(CausalLMSequential.count_loss_tokens(ids) for ids in batches)
    model.eval()
    try:
        with torch.no_grad():
            return sum(batch_loss(args, model, hf, ids.to(args.device), tokens).item() for ids in batches)
    finally:
        model.train()
