"""The stages a causal LM is cut into, each built around the model's own submodules: the embedding
stages (Llama layout, GPT-2), a decoder layer called as the model calls it, and the head (final
norm and ``lm_head``, logits or the chunked loss: Note: [Chunked loss] in ``transformers_stages.py``).

Each does what the model's forward does at that place, operation for operation. This file does not
decide which stages a model gets (``transformers_stages.py``) or what a family departs from Llama
in (``transformers_families.py``); what travels between the stages is in ``transformers_batch.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..autograd.recompute_state import recomputing
from .transformers_batch import IGNORE_INDEX, ROUTER_LOGITS, _default_positions, _State, _unpack_batch
from .transformers_families import _Layout
from .transformers_masks import _MaskCache
from .transformers_router import RouterCapture


class _EmbeddingStage(nn.Module):
    """What the first stage of every family does before embedding: a new run of the slices begins,
    so the 4-D masks built for the last one go (:class:`_MaskCache`), and the batch is read, with
    its labels when the head computes the loss."""

    def __init__(self, masks: _MaskCache | None, with_labels: bool, router_logits: bool = False) -> None:
        super().__init__()
        self.masks = masks if masks is not None else _MaskCache()
        self.with_labels = with_labels
        self.router_logits = router_logits

    def _begin(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                          torch.Tensor | str | None, tuple[()] | None]:
        self.masks.clear()  # a new forward (or microbatch): nothing built before it applies
        unpacked = _unpack_batch(batch, self.with_labels)
        if unpacked[4] is not None and not self.router_logits:
            raise TypeError(f"the batch asks for router logits ({ROUTER_LOGITS!r}), which these stages were not cut to "
                            "carry: causal_lm_sequential(model, router_logits=True), for a mixture of experts whose "
                            "family computes a load-balancing loss from them")
        return unpacked


class LlamaEmbedding(_EmbeddingStage):
    """Token embedding and rotary tables of a Llama-layout model (its own ``embed_tokens`` and
    ``rotary_emb``), with the embedding multiplier or dropout of the families that have one.

    With ``rotary_layer_types`` the rotary tables are a dict, one entry per layer type, as the model
    builds them; otherwise one ``(cos, sin)`` pair shared by every layer.
    """

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module, *, multiplier: float | None = None,
                 dropout: nn.Module | None = None, rotary_layer_types: tuple[str, ...] | None = None,
                 masks: _MaskCache | None = None, with_labels: bool = False, router_logits: bool = False) -> None:
        super().__init__(masks, with_labels, router_logits)
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.multiplier = multiplier
        self.dropout = dropout
        self.rotary_layer_types = rotary_layer_types

    def forward(self, batch: Any) -> _State:
        input_ids, attention_mask, position_ids, targets, router = self._begin(batch)
        hidden = self.embed_tokens(input_ids)
        if self.multiplier is not None:
            hidden = hidden * self.multiplier
        positions = _default_positions(hidden, position_ids)
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        if self.rotary_layer_types is None:
            position_embeddings = self.rotary_emb(hidden, position_ids=positions)
        else:
            position_embeddings = {kind: self.rotary_emb(hidden, positions, kind)
                                   for kind in self.rotary_layer_types}
        # The user's position ids travel on, absent ones stay absent (Note: [Default positions]).
        return hidden, attention_mask, position_ids, position_embeddings, targets, router


class GPT2Embedding(_EmbeddingStage):
    """GPT-2's token and position embeddings and their dropout (its own ``wte``, ``wpe``, ``drop``)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout, masks: _MaskCache | None = None,
                 with_labels: bool = False) -> None:
        super().__init__(masks, with_labels)
        self.wte = wte
        self.wpe = wpe
        self.drop = drop

    def forward(self, batch: Any) -> _State:
        input_ids, attention_mask, position_ids, targets, router = self._begin(batch)
        batch_size = input_ids.shape[0]
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        hidden = self.wte(input_ids)
        hidden = self.drop(hidden + self.wpe(_default_positions(hidden, position_ids)))
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        if isinstance(targets, torch.Tensor):
            targets = targets.view(input_ids.shape)
        return hidden, attention_mask, position_ids, None, targets, router


class DecoderLayer(nn.Module):
    """One of the model's decoder layers, called as the model calls it, with its attention mask
    rebuilt from the 2-D mask by the model's mask function for that layer.

    The keywords are those the model's decoder passes, less the (absent) cache: ``layout`` says
    whether ``use_cache`` goes at all, and whether the layer takes the rotary tables of its own layer
    type (``layer_type``). ``layout=None`` calls a GPT-2 block. ``routers`` records the layer's
    router logits where the state carries them (Note: [Router logits] in ``transformers_router.py``).
    """

    def __init__(self, layer: nn.Module, config: Any, mask_function: Callable[..., Any],
                 layout: _Layout | None, layer_type: str | None = None, masks: _MaskCache | None = None,
                 routers: RouterCapture | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        self.mask_function = mask_function
        self.layout = layout
        self.layer_type = layer_type
        self.masks = masks if masks is not None else _MaskCache()
        self.routers = routers

    def forward(self, state: _State) -> _State:
        hidden, attention_mask, position_ids, position_embeddings, targets, router = state
        if router is None or self.routers is None:
            hidden = self._run(hidden, attention_mask, position_ids, position_embeddings)
        else:
            rows, length = hidden.shape[:2]
            with self.routers.capturing() as captured:
                hidden = self._run(hidden, attention_mask, position_ids, position_embeddings)
            router = router + tuple(logits.reshape(rows, length, -1) for logits in captured)
        return hidden, attention_mask, position_ids, position_embeddings, targets, router

    def _run(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
             position_embeddings: Any) -> torch.Tensor:
        mask_positions = position_ids if self.layout is None or self.layout.mask_from_positions else None
        mask = self.masks.build(self.mask_function, self.config, hidden, attention_mask, mask_positions)
        positions = _default_positions(hidden, position_ids)  # Note: [Default positions]
        if self.layout is None:
            # Positional as GPT2Model passes them (cache, attention_mask, encoder_hidden_states).
            return self.layer(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False,
                              position_ids=positions)
        # No cache keyword: every layer's cache defaults to None, and its name changed across
        # transformers 5 releases (``past_key_values``, ``layer_past``, ``cache``), the old ones warned of.
        kwargs = {"use_cache": False} if self.layout.layers_take_use_cache else {}
        own = position_embeddings if self.layer_type is None else position_embeddings[self.layer_type]
        return self.layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=own, **kwargs)


class Head(nn.Module):
    """The final norm and the output projection (the model's own ``norm``/``ln_f`` and ``lm_head``);
    returns logits, or with ``loss_chunk_tokens`` each row's summed token losses (Note: [Chunked loss]).

    What a family does to the logits after the projection follows, operation for operation:
    ``logit_scale`` multiplies them (Cohere), ``logits_scaling`` divides them (Granite),
    ``softcap`` soft-caps them (Gemma 2 and 3). Each is ``None`` where the family does not.
    """

    def __init__(self, norm: nn.Module, lm_head: nn.Module, *, logit_scale: float | None = None,
                 logits_scaling: float | None = None, softcap: float | None = None,
                 loss_chunk_tokens: int | None = None) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head
        self.logit_scale = logit_scale
        self.logits_scaling = logits_scaling
        self.softcap = softcap
        self.loss_chunk_tokens = loss_chunk_tokens

    def forward(self, state: _State) -> torch.Tensor | tuple[torch.Tensor, ...]:
        output = self._output(state)
        router = state[5]
        return output if router is None else (output, *router)  # Note: [Router logits], rule 2

    def _output(self, state: _State) -> torch.Tensor:
        hidden = self.norm(state[0])
        if isinstance(state[4], str):  # LAST_HIDDEN_STATE: the caller projects them
            return hidden
        if self.loss_chunk_tokens is None:
            return self.logits(hidden)
        return self.loss_sums(hidden, state[4])

    def loss_sums(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each row's sum of token cross-entropies (float32, shape ``B``) from the normed ``B x T``
        hidden states, over chunks of ``loss_chunk_tokens`` tokens of the flattened batch (the last
        may be shorter): a chunk may end inside a row and the next go on there, so the batch takes
        the fewest projections, each reading the whole output matrix once."""
        batch, length = targets.shape
        flat_hidden = hidden.reshape(batch * length, hidden.shape[-1])
        rows = torch.arange(batch, device=targets.device).repeat_interleave(length)
        sums = torch.zeros(batch, dtype=torch.float32, device=hidden.device)
        size = self.loss_chunk_tokens
        for h, t, r in zip(flat_hidden.split(size), targets.reshape(-1).split(size), rows.split(size)):
            sums = sums.index_add(0, r, self._chunk(h, t))
        return sums

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._chunk_loss(hidden, targets)
        # A plain head draws no random numbers: no RNG state to save and restore for the recompute.
        # One an adapter wraps in training mode may (LoRA's dropout, LoHa's rank dropout): its
        # recompute replays the draws its forward made, and leaves the generators as they were.
        # The recompute runs under offload's recomputing() flag, so hooks on lm_head can tell it
        # from a forward, as for a slice's recompute (offload.is_recomputing()).
        return checkpoint(self._chunk_loss, hidden, targets, use_reentrant=False,
                          preserve_rng_state=_may_draw(self.lm_head), context_fn=_recompute_contexts)

    def _chunk_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # As ForCausalLMLoss: float32 logits, one loss per token (reduction="none" keeps the rows
        # apart; each value is the addend reduction="sum" would take).
        logits = self.logits(hidden).float()
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the normed hidden states: the projection and what the family does after it."""
        logits = self.lm_head(hidden)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.softcap is not None:
            # Three steps, as the models write them: a fused form rounds differently.
            logits = logits / self.softcap
            logits = torch.tanh(logits)
            logits = logits * self.softcap
        return logits


def _may_draw(head: nn.Module) -> bool:
    """Whether ``head`` may draw random numbers: some module in it that is not a plain ``Linear``
    (an adapter's dropout, say) is in training mode."""
    return any(m.training and type(m) is not nn.Linear for m in head.modules())


def _recompute_contexts() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    # torch.utils.checkpoint's context_fn: (around the forward, around the recompute).
    return contextlib.nullcontext(), recomputing()
