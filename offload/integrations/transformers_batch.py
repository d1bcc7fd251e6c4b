"""What a batch for the stages of a causal LM holds, and what travels from one stage to the next.

What travels between stages is ``(hidden_states, attention_mask, position_ids, position_embeddings,
loss_targets, router_logits)``: the 2-D attention mask as the user passed it (or ``None``) rather than the 4-D
mask, which each slice rebuilds with the model's own mask functions (once per kind of mask: :class:`_MaskCache` in
``transformers_masks.py``),
because a ``B x 1 x T x T`` mask at every slice boundary would be checkpointed to the host once per
slice; rotary tables (``T x head_dim``,
one pair per layer type where the family has several) are small and computed once. None of them
requires grad, exactly as in the model (Note: [Boundary gradients] in ``offload/autograd/slice_graph.py``).
``loss_targets`` is ``None`` unless the head computes the loss (Note: [Chunked loss] in
``transformers_stages.py``); then it is the
shifted labels, an integer tensor that the decoder stages pass along untouched. A batch with
``"last_hidden_state": True`` makes it the string :data:`LAST_HIDDEN_STATE` instead, and the head then
returns the normed hidden states (what the model's decoder returns as ``last_hidden_state``), for
callers that project them themselves (TRL's fused LM head). ``router_logits`` is ``None`` unless the
batch holds ``"output_router_logits": True``; then it is a tuple of the router logits of the layers run
so far (Note: [Router logits] in ``transformers_router.py``), and the head returns them after its output.

This file holds the batch's keys, its reading by the first stage (:func:`_unpack_batch`), the
loss targets and the default positions (Note: [Default positions]); not the stages themselves
(``transformers_layers.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn import functional as F

#: Keys a batch dict may hold. Labels only when the head computes the loss (``loss_chunk_tokens``):
#: otherwise the stages return logits, and a silently ignored ``labels`` would look like a loss that
#: is never computed.
_BATCH_KEYS = ("input_ids", "attention_mask", "position_ids")
#: ``loss_targets`` when the head returns the normed hidden states rather than logits or the loss.
LAST_HIDDEN_STATE = "last_hidden_state"
#: The batch key that makes the stages carry a mixture of experts' router logits to the head.
ROUTER_LOGITS = "output_router_logits"
_LABEL_KEYS = ("labels", "shift_labels")
#: The label of a position the loss skips, as in transformers' ``ForCausalLMLoss``.
IGNORE_INDEX = -100

_State = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, Any, "torch.Tensor | None",
               "tuple[torch.Tensor, ...] | None"]


def _unpack_batch(batch: Any, with_labels: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                                          torch.Tensor | str | None, tuple[()] | None]:
    """The input ids, attention mask, position ids, loss targets and (where the batch asks for router
    logits) the empty tuple they start from."""
    if isinstance(batch, torch.Tensor) and not with_labels:
        return batch, None, None, None, None
    if not isinstance(batch, Mapping):
        what = "a dict with 'input_ids' and 'labels'" if with_labels else "a tensor of input ids or a dict of tensors"
        raise TypeError(f"the batch must be {what}, not {type(batch).__name__} (a tokenizer's BatchEncoding: "
                        "pass dict(batch))")
    batch = {key: value for key, value in batch.items() if value is not None}  # None: as if absent, as in HF
    if batch.pop(LAST_HIDDEN_STATE, False) is True:
        with_labels = False  # no loss: the caller projects the hidden states itself
        hidden_only = True
    else:
        hidden_only = False
    asked = batch.pop(ROUTER_LOGITS, False)
    if not isinstance(asked, bool):  # a truthy value ignored would leave the loss's router term out, silently
        raise TypeError(f"the batch's {ROUTER_LOGITS!r} must be True or False, got {asked!r}")
    router = () if asked else None
    unknown = sorted(set(batch) - set(_BATCH_KEYS + (_LABEL_KEYS if with_labels else ())))
    if with_labels and "input_ids" in batch and not unknown and not any(key in batch for key in _LABEL_KEYS):
        raise TypeError(f"with loss_chunk_tokens the model returns the loss: the batch needs 'labels' (or "
                        f"'shift_labels'); got keys {sorted(batch)}")
    if unknown or "input_ids" not in batch:
        if with_labels:
            raise TypeError(f"the batch must be a dict with 'input_ids', 'labels' (or 'shift_labels') and optionally "
                            f"'attention_mask' and 'position_ids'; got keys {sorted(batch)}")
        raise TypeError(
            f"the batch must be input ids, or a dict with 'input_ids' and optionally 'attention_mask' and "
            f"'position_ids'; got keys {sorted(batch)}. The model returns logits: compute the loss from them "
            "(hf_model.loss_function(logits=logits, labels=labels, vocab_size=hf_model.config.vocab_size)), or "
            "let the head compute it chunk by chunk: causal_lm_sequential(hf_model, loss_chunk_tokens=...)"
        )
    input_ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        # A family's decoder takes a dict of ready masks, one per layer type, where the stages build
        # each layer's mask from one tensor: its failure inside transformers named nothing.
        raise TypeError(
            f"the batch's 'attention_mask' must be a tensor (a 2-D padding mask, or a 4-D mask), not "
            f"{type(mask).__name__}: a dict of masks per layer type is not supported. Pass the 2-D padding mask "
            "(or none, for packed sequences' position_ids) and each layer's mask is built from it as the model does")
    targets = _loss_targets(input_ids, batch.get("labels"), batch.get("shift_labels")) if with_labels else None
    if hidden_only:
        targets = LAST_HIDDEN_STATE
    return input_ids, batch.get("attention_mask"), batch.get("position_ids"), targets, router


def _loss_targets(input_ids: torch.Tensor, labels: torch.Tensor | None,
                  shift_labels: torch.Tensor | None) -> torch.Tensor:
    # As ForCausalLMLoss: shift_labels as given when there are any, else the labels shifted left by
    # one (position t is scored against token t + 1) with IGNORE_INDEX after the last token.
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    if shift_labels.dtype != torch.long or shift_labels.shape != input_ids.shape:
        raise ValueError(f"labels must be token ids (torch.long) shaped like input_ids {tuple(input_ids.shape)}, "
                         f"with {IGNORE_INDEX} where no token counts; got {shift_labels.dtype} of shape "
                         f"{tuple(shift_labels.shape)}")
    return shift_labels


def _default_positions(hidden: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """As the models do without a cache: positions 0..T-1, one row shared by the batch.

    Note: [Default positions]
        Made where a module takes them (the embeddings, the rotary tables, each decoder layer), not
        carried between stages: the mask functions look for packed sequences in any
        ``position_ids`` they are given (``find_packed_sequence_indices``), reading a value on the
        host, which on a GPU waits for the device to finish its queued work, in every slice's
        forward and recompute. Measured on an H100 (benchmarks/results/h100-2026-11-26), 32 such
        waits took a 0.9 B Llama's step from 0.16 s of compute to 0.33 s. Positions 0..T-1 are
        never packed, so the masks built without them are the same; the model itself looks once
        per forward. Position ids a user passes travel with the batch and are looked at as the
        model would.
    """
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
