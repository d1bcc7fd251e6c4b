"""Hugging Face causal language models as an ``nn.Sequential`` that :class:`~offload.OffloadModel` can wrap.

:func:`causal_lm_sequential` cuts a ``transformers`` ``*ForCausalLM`` (GPT-2, and the families
built on the Llama decoder layout: Llama, Mistral, Ministral, Mixtral, Qwen2, Qwen3 and their
mixture-of-experts variants, Gemma, Gemma 2, Gemma 3 text, Phi, Phi-3, OLMo, OLMo 2, OLMo 3,
SmolLM3, Granite, Cohere, GLM, GLM-4, Helium, StableLM, GPT-NeoX) into stages built around the
model's *own* submodules: an embedding stage, one stage per decoder layer and a head stage (final
norm and ``lm_head``). Nothing is copied, so the Hugging Face model trains along: its
``state_dict()`` and ``save_pretrained()`` hold the trained weights. The stages reproduce the
model's forward operation for operation, so logits are bit-identical to the model's own, in train
mode with dropout and in eval mode, with padding and attention masks, with
``gradient_checkpointing_enable()``, and under ``compute_dtype``. Where a family's forward departs
from Llama's (an embedding multiplier, a mask or rotary table per layer type, a scale or soft-cap
on the logits), a :class:`_Layout` says so and the stages do the same step in the same place.

What travels between stages is ``(hidden_states, attention_mask, position_ids, position_embeddings,
loss_targets)``: the 2-D attention mask as the user passed it (or ``None``) rather than the 4-D
mask, which each slice rebuilds with the model's own mask functions (once per kind of mask: :class:`_MaskCache`),
because a ``B x 1 x T x T`` mask at every slice boundary would be checkpointed to the host once per
slice; rotary tables (``T x head_dim``,
one pair per layer type where the family has several) are small and computed once. None of them
requires grad, exactly as in the model (Note: [Boundary gradients] in ``offload/autograd/slice_graph.py``).
``loss_targets`` is ``None`` unless the head computes the loss (Note: [Chunked loss]); then it is the
shifted labels, an integer tensor that the decoder stages pass along untouched. A batch with
``"last_hidden_state": True`` makes it the string :data:`LAST_HIDDEN_STATE` instead, and the head then
returns the normed hidden states (what the model's decoder returns as ``last_hidden_state``), for
callers that project them themselves (TRL's fused LM head).

Note: [Chunked loss]
    The logits of a batch are ``B x T x vocab``: 8 x 2048 tokens of a 128k vocabulary are 8.4 GB in
    float32, before the loss's log-softmax and their gradient, far more than a slice of decoder
    layers. With ``loss_chunk_tokens=N`` the head returns, instead of logits, each row's sum of
    token cross-entropies in float32 (shape ``B``, so microbatches join along dim 0), computed
    over ``N`` tokens of the flattened batch at a time (a chunk may end inside a row; the last may be
    shorter), each chunk under non-reentrant ``torch.utils.checkpoint``:
    a chunk's logits, their float32 copy and log-softmax are freed as soon as its partial sums are
    taken, and backward recomputes them one chunk at a time. Each chunk does what the model and
    transformers' ``ForCausalLMLoss`` do to the whole batch, in the same order and dtypes: the
    projection, the family's scale or soft-cap, ``.float()``, ``cross_entropy`` with
    ``ignore_index=-100``; labels are shifted as that loss shifts them. The final norm runs once
    on the whole batch, outside the chunks (its output is ``B x T x hidden``, small beside the logits).

    A token's loss and gradient do not depend on the other tokens, so what changes is rounding.
    The loss adds the token losses in another order (float32 rounding). The ``lm_head`` gradient
    is a sum over tokens, now added chunk by chunk, in the compute dtype. Every other gradient
    comes from the hidden states' per-token gradients, which are the model's bit for bit when the
    projection computes a row the same whatever the number of rows: always for one chunk of the
    whole batch (the same products); for smaller chunks it depends on the kernels (the CPU's
    float32 ones did for products of 20 tokens but not of 10 or fewer; its bfloat16 ones did at
    every size tried), and where they do not, every gradient moves by a few ulps
    (``GRAD_ROUNDING`` in ``tests/test_transformers.py`` has the figures).

A ``peft`` model is cut as its base model, adapters in place (Note: [PEFT models] in ``peft.py``).

This module holds the adapters only; it does not train, load weights or tokenize. Users import it
through ``offload.integrations.transformers``, which adds loading and the trainers' model.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from ..autograd.recompute_state import recomputing
from .peft import peft_base_model

try:
    import transformers
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        'offload.integrations.transformers needs Hugging Face transformers 5: pip install -e ".[transformers]"'
    ) from error

__all__ = ["LAST_HIDDEN_STATE", "SUPPORTED_MODEL_TYPES", "CausalLMSequential", "causal_lm_sequential"]


@dataclass(frozen=True)
class _Layout:
    """Where a family's forward departs from Llama's (``LlamaModel`` and ``LlamaForCausalLM``), as read
    in its ``modeling_*.py``. The stages do each of these steps where the model does them, and no
    other; whatever a family does inside its own modules (Gemma's scaled embedding, Granite's
    residual multiplier, attention soft-capping, layers without rotary) comes along unchanged.
    """

    #: The attribute of the ``*ForCausalLM`` that holds the decoder.
    base: str = "model"
    #: The decoder's final norm.
    final_norm: str = "norm"
    #: The decoder's dropout module on the embeddings, if it has one.
    embed_dropout: str | None = None
    #: Which 4-D mask a layer gets: ``"causal"`` (the causal mask for every layer), ``"sliding_window"``
    #: (one mask for every layer, sliding when ``config.sliding_window`` is set) or ``"layer_types"``
    #: (``config.layer_types[i]`` says which of the two layer ``i`` gets).
    mask: Literal["causal", "sliding_window", "layer_types"] = "causal"
    #: One rotary table per layer type (``rotary_emb(x, position_ids, layer_type)``), each layer taking its own.
    rotary_per_layer_type: bool = False
    #: The decoder passes ``use_cache`` to its layers.
    layers_take_use_cache: bool = True
    #: The embeddings are multiplied by the decoder's ``embedding_multiplier`` before the first layer.
    embedding_multiplier: bool = False
    #: The logits are multiplied by the ``*ForCausalLM``'s ``logit_scale``.
    logit_scale: bool = False
    #: The logits are divided by ``config.logits_scaling``.
    logits_scaling: bool = False
    #: The logits are soft-capped, ``tanh(logits / cap) * cap``, when ``config.final_logit_softcapping`` is set.
    final_logit_softcapping: bool = False


_MASK_PER_LAYER_TYPE = _Layout(mask="layer_types")

#: The families cut around the Llama decoder layout, each checked bit for bit against the model's own
#: forward in ``tests/test_transformers.py``.
_LAYOUTS = {
    "llama": _Layout(),
    "mistral": _Layout(mask="sliding_window"),
    "ministral": _MASK_PER_LAYER_TYPE,
    "qwen2": _MASK_PER_LAYER_TYPE,
    "qwen3": _MASK_PER_LAYER_TYPE,
    "gemma": _Layout(),
    "gemma2": _Layout(mask="layer_types", layers_take_use_cache=False, final_logit_softcapping=True),
    "gemma3_text": _Layout(mask="layer_types", rotary_per_layer_type=True, layers_take_use_cache=False,
                           final_logit_softcapping=True),
    "phi": _Layout(final_norm="final_layernorm", embed_dropout="embed_dropout"),
    "phi3": _Layout(mask="sliding_window"),
    "olmo": _Layout(),
    "olmo2": _Layout(),
    "olmo3": _Layout(mask="layer_types", rotary_per_layer_type=True, layers_take_use_cache=False),
    "smollm3": _MASK_PER_LAYER_TYPE,
    "granite": _Layout(embedding_multiplier=True, logits_scaling=True),
    "cohere": _Layout(logit_scale=True),
    "glm": _Layout(),
    "glm4": _Layout(),
    "helium": _Layout(),
    "stablelm": _Layout(),
    "gpt_neox": _Layout(base="gpt_neox", final_norm="final_layer_norm", embed_dropout="emb_dropout"),
    # Mixture of experts: the routing happens inside the layers; the load-balancing loss is refused below.
    "mixtral": _Layout(mask="sliding_window"),
    "qwen2_moe": _MASK_PER_LAYER_TYPE,
    "qwen3_moe": _Layout(mask="sliding_window"),
}

#: ``config.model_type`` values this module can cut. Others share parts of the layout but differ in
#: details that change results (embedding dropout outside a module, positions as attention biases,
#: router losses), or have not been checked, so they are refused rather than approximated.
SUPPORTED_MODEL_TYPES = ("gpt2", *_LAYOUTS)

#: Keys a batch dict may hold. Labels only when the head computes the loss (``loss_chunk_tokens``):
#: otherwise the stages return logits, and a silently ignored ``labels`` would look like a loss that
#: is never computed.
_BATCH_KEYS = ("input_ids", "attention_mask", "position_ids")
#: ``loss_targets`` when the head returns the normed hidden states rather than logits or the loss.
LAST_HIDDEN_STATE = "last_hidden_state"
_LABEL_KEYS = ("labels", "shift_labels")
#: The label of a position the loss skips, as in transformers' ``ForCausalLMLoss``.
IGNORE_INDEX = -100

_State = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, Any, "torch.Tensor | None"]


def _unpack_batch(batch: Any, with_labels: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                                          torch.Tensor | None]:
    if isinstance(batch, torch.Tensor) and not with_labels:
        return batch, None, None, None
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
    targets = _loss_targets(input_ids, batch.get("labels"), batch.get("shift_labels")) if with_labels else None
    if hidden_only:
        targets = LAST_HIDDEN_STATE
    return input_ids, batch.get("attention_mask"), batch.get("position_ids"), targets


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


class _EmbeddingStage(nn.Module):
    """What the first stage of every family does before embedding: a new run of the slices begins,
    so the 4-D masks built for the last one go (:class:`_MaskCache`), and the batch is read, with
    its labels when the head computes the loss."""

    def __init__(self, masks: _MaskCache | None, with_labels: bool) -> None:
        super().__init__()
        self.masks = masks if masks is not None else _MaskCache()
        self.with_labels = with_labels

    def _begin(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        self.masks.clear()  # a new forward (or microbatch): nothing built before it applies
        return _unpack_batch(batch, self.with_labels)


class LlamaEmbedding(_EmbeddingStage):
    """Token embedding and rotary tables of a Llama-layout model (its own ``embed_tokens`` and
    ``rotary_emb``), with the embedding multiplier or dropout of the families that have one.

    With ``rotary_layer_types`` the rotary tables are a dict, one entry per layer type, as the model
    builds them; otherwise one ``(cos, sin)`` pair shared by every layer.
    """

    def __init__(self, embed_tokens: nn.Module, rotary_emb: nn.Module, *, multiplier: float | None = None,
                 dropout: nn.Module | None = None, rotary_layer_types: tuple[str, ...] | None = None,
                 masks: _MaskCache | None = None, with_labels: bool = False) -> None:
        super().__init__(masks, with_labels)
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.multiplier = multiplier
        self.dropout = dropout
        self.rotary_layer_types = rotary_layer_types

    def forward(self, batch: Any) -> _State:
        input_ids, attention_mask, position_ids, targets = self._begin(batch)
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
        return hidden, attention_mask, position_ids, position_embeddings, targets


class GPT2Embedding(_EmbeddingStage):
    """GPT-2's token and position embeddings and their dropout (its own ``wte``, ``wpe``, ``drop``)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout, masks: _MaskCache | None = None,
                 with_labels: bool = False) -> None:
        super().__init__(masks, with_labels)
        self.wte = wte
        self.wpe = wpe
        self.drop = drop

    def forward(self, batch: Any) -> _State:
        input_ids, attention_mask, position_ids, targets = self._begin(batch)
        batch_size = input_ids.shape[0]
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        hidden = self.wte(input_ids)
        hidden = self.drop(hidden + self.wpe(_default_positions(hidden, position_ids)))
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        if isinstance(targets, torch.Tensor):
            targets = targets.view(input_ids.shape)
        return hidden, attention_mask, position_ids, None, targets


class _MaskCache:
    """The 4-D masks of the decoder stages, built once per run of a slice rather than once per layer.

    The plain model builds each kind of mask once per forward and hands it to every layer. Building
    one costs more than its arithmetic: the mask functions look at mask and position values from
    the host (is there padding? are sequences packed?), which on a GPU waits for the device to
    catch up, once per call. The stages of one slice receive the same ``attention_mask`` and
    ``position_ids`` objects, so the mask built for them is reused while they are the ones coming
    in; a new slice, microbatch or recompute gets new ones. One mask per kind is kept, dropped when
    either tensor is freed; the key includes their versions (a mask changed in place is seen) and
    the attention implementation the mask is built for. Anything else (inference tensors, which
    have no version; a flex-attention ``BlockMask``) is not cached.
    """

    def __init__(self) -> None:
        self._masks: dict[Callable[..., Any], tuple[tuple[Any, ...], Any]] = {}
        self._watched: set[tuple[Callable[..., Any], int]] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"_masks": {}, "_watched": set()}  # masks of a run in progress are not part of the model

    def clear(self) -> None:
        self._masks.clear()

    def build(self, function: Callable[..., Any], config: Any, hidden: torch.Tensor,
              attention_mask: Any, position_ids: Any) -> Any:
        def call() -> Any:
            # The (absent) cache goes by position: transformers 5.24 renamed the keyword from
            # ``past_key_values`` to ``cache`` and warns on the old name, 5.20 knows only the old one.
            return function(config, hidden, attention_mask, None, position_ids=position_ids)

        keyed = [t for t in (position_ids, attention_mask) if t is not None]
        if not keyed or not all(type(t) is torch.Tensor and not t.is_inference() for t in keyed):
            return call()
        key = (hidden.shape, hidden.dtype, hidden.device, getattr(config, "_attn_implementation", None),
               *((id(t), t._version) for t in keyed))
        entry = self._masks.get(function)
        if entry is not None and entry[0] == key:
            return entry[1]
        mask = call()
        self._masks[function] = (key, mask)
        for tensor in keyed:
            # Forget the mask when the tensor is freed: its id may then be reused by another tensor.
            if (function, id(tensor)) not in self._watched:
                self._watched.add((function, id(tensor)))
                weakref.finalize(tensor, self._forget, function, id(tensor))
        return mask

    def _forget(self, function: Callable[..., Any], tensor_id: int) -> None:
        self._watched.discard((function, tensor_id))
        entry = self._masks.get(function)
        if entry is not None and any(part[0] == tensor_id for part in entry[0][4:]):
            del self._masks[function]


class DecoderLayer(nn.Module):
    """One of the model's decoder layers, called as the model calls it, with its attention mask
    rebuilt from the 2-D mask by the model's mask function for that layer.

    The keywords are those the model's decoder passes, less the (absent) cache: ``layout`` says
    whether ``use_cache`` goes at all, and whether the layer takes the rotary tables of its own layer
    type (``layer_type``). ``layout=None`` calls a GPT-2 block.
    """

    def __init__(self, layer: nn.Module, config: Any, mask_function: Callable[..., Any],
                 layout: _Layout | None, layer_type: str | None = None, masks: _MaskCache | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        self.mask_function = mask_function
        self.layout = layout
        self.layer_type = layer_type
        self.masks = masks if masks is not None else _MaskCache()

    def forward(self, state: _State) -> _State:
        hidden, attention_mask, position_ids, position_embeddings, targets = state
        mask = self.masks.build(self.mask_function, self.config, hidden, attention_mask, position_ids)
        positions = _default_positions(hidden, position_ids)  # Note: [Default positions]
        if self.layout is None:
            # Positional as GPT2Model passes them (cache, attention_mask, encoder_hidden_states).
            hidden = self.layer(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False,
                                position_ids=positions)
            return hidden, attention_mask, position_ids, position_embeddings, targets
        # No cache keyword: every layer's cache defaults to None, and its name changed across
        # transformers 5 releases (``past_key_values``, ``layer_past``, ``cache``), the old ones warned of.
        kwargs = {"use_cache": False} if self.layout.layers_take_use_cache else {}
        own = position_embeddings if self.layer_type is None else position_embeddings[self.layer_type]
        hidden = self.layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=own, **kwargs)
        return hidden, attention_mask, position_ids, position_embeddings, targets


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

    def forward(self, state: _State) -> torch.Tensor:
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
        # The head draws no random numbers: no RNG state to save and restore for the recompute.
        # The recompute runs under offload's recomputing() flag, so hooks on lm_head can tell it
        # from a forward, as for a slice's recompute (offload.is_recomputing()).
        return checkpoint(self._chunk_loss, hidden, targets, use_reentrant=False, preserve_rng_state=False,
                          context_fn=_recompute_contexts)

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


def _recompute_contexts() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    # torch.utils.checkpoint's context_fn: (around the forward, around the recompute).
    return contextlib.nullcontext(), recomputing()


class CausalLMSequential(nn.Sequential):
    """The stages of a causal LM, with the way back to the Hugging Face parameter names.

    Attributes:
        hf_model: the model the stages were cut from (sharing every module with it).
        loss_chunk_tokens: the tokens per chunk of the loss the head computes, or ``None`` when it returns logits.
    """

    def __init__(self, stages: list[nn.Module], hf_model: nn.Module, loss_chunk_tokens: int | None = None) -> None:
        super().__init__(*stages)
        self.loss_chunk_tokens = loss_chunk_tokens
        # Not a submodule: the stages already hold its modules, and registering it would list
        # every parameter twice.
        object.__setattr__(self, "hf_model", hf_model)
        #: this Sequential's module name -> the Hugging Face model's, for every module of a stage
        self._hf_names = self._module_names()

    def _module_names(self) -> dict[str, str]:
        names = {id(module): name for name, module in self.hf_model.named_modules()}
        return {name: names[id(module)] for name, module in self.named_modules() if name and id(module) in names}

    def hf_name(self, key: str) -> str:
        """The Hugging Face name of a ``state_dict`` key of this Sequential, or of an ``OffloadModel`` wrapping it.

        Raises:
            KeyError: ``key`` names no parameter or buffer of a stage.
        """
        module, _, leaf = key.rpartition(".")
        if module not in self._hf_names:
            self._hf_names = self._module_names()  # modules added since, adapters say
        if module not in self._hf_names:
            raise KeyError(f"{key!r} is not a parameter or buffer of these stages")
        return f"{self._hf_names[module]}.{leaf}" if self._hf_names[module] else leaf

    def hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` (of this Sequential or of an ``OffloadModel`` wrapping it) under Hugging Face names."""
        return {self.hf_name(key): value for key, value in state_dict.items()}

    @staticmethod
    def count_loss_tokens(labels: torch.Tensor | None = None, *,
                          shift_labels: torch.Tensor | None = None) -> torch.Tensor:
        """The number of tokens a causal LM loss counts: labels other than -100 once shifted (the
        first position's label scores nothing), or in ``shift_labels`` as given. Transformers calls
        it ``num_items_in_batch``; with ``loss_chunk_tokens`` the mean loss is
        ``output.sum() / count_loss_tokens(labels)``. For gradient accumulation, add the counts of
        every microstep's labels and divide each microstep's sum by the total, as the ``Trainer`` does.

        Args:
            labels: the labels as passed to the model (unshifted, -100 where nothing counts).
            shift_labels: labels already shifted; counted as they are (``labels`` is then not used).

        Returns:
            A 0-dim ``torch.long`` tensor on the labels' device (no host sync).

        Raises:
            ValueError: neither ``labels`` nor ``shift_labels`` given.

        Example::

            sums = model({"input_ids": ids, "attention_mask": mask, "labels": labels})
            loss = sums.sum() / layers.count_loss_tokens(labels)
        """
        if shift_labels is None:
            if labels is None:
                raise ValueError("count_loss_tokens needs labels or shift_labels")
            shift_labels = labels[..., 1:]
        return (shift_labels != IGNORE_INDEX).sum()


def _mask_function(layout: _Layout, config: Any, index: int) -> Callable[..., Any]:
    if layout.mask == "layer_types":
        sliding = config.layer_types[index] == "sliding_attention"
    elif layout.mask == "sliding_window":
        sliding = config.sliding_window is not None
    else:
        sliding = False
    return create_sliding_window_causal_mask if sliding else create_causal_mask


def _stages(model: nn.Module, loss_chunk_tokens: int | None) -> list[nn.Module]:
    config = model.config
    with_labels = loss_chunk_tokens is not None
    if config.model_type == "gpt2":
        base = model.transformer
        masks = _MaskCache()
        blocks = [DecoderLayer(block, config, create_causal_mask, layout=None, masks=masks) for block in base.h]
        return [GPT2Embedding(base.wte, base.wpe, base.drop, masks, with_labels=with_labels), *blocks,
                Head(base.ln_f, model.lm_head, loss_chunk_tokens=loss_chunk_tokens)]
    layout = _LAYOUTS[config.model_type]
    base = getattr(model, layout.base)
    per_type = layout.rotary_per_layer_type
    masks = _MaskCache()  # shared by the decoder stages, as the model shares its masks across layers
    embedding = LlamaEmbedding(
        model.get_input_embeddings(), base.rotary_emb,
        multiplier=base.embedding_multiplier if layout.embedding_multiplier else None,
        dropout=getattr(base, layout.embed_dropout) if layout.embed_dropout else None,
        # dict.fromkeys: each type once, in a fixed order (the model iterates a set; the tables do not depend on it)
        rotary_layer_types=tuple(dict.fromkeys(config.layer_types)) if per_type else None, masks=masks,
        with_labels=with_labels)
    blocks = [DecoderLayer(layer, config, _mask_function(layout, config, i), layout,
                           layer_type=config.layer_types[i] if per_type else None, masks=masks)
              for i, layer in enumerate(base.layers[:config.num_hidden_layers])]
    head = Head(getattr(base, layout.final_norm), model.lm_head,
                logit_scale=model.logit_scale if layout.logit_scale else None,
                logits_scaling=config.logits_scaling if layout.logits_scaling else None,
                softcap=config.final_logit_softcapping if layout.final_logit_softcapping else None,
                loss_chunk_tokens=loss_chunk_tokens)
    return [embedding, *blocks, head]


def _check_classes(model: nn.Module) -> None:
    """Refuse a model whose forward, or whose decoder's, is not the one the stages reproduce.

    ``config.model_type`` names a family, not a class: ``GPT2DoubleHeadsModel`` is ``"gpt2"`` too
    but adds a second head, and a subclass may override ``forward``. A subclass that keeps both
    forwards (one that adds a method, say) computes what the family's causal LM computes, and is accepted.
    """
    model_type = model.config.model_type
    expected = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    expected_base = getattr(transformers, MODEL_MAPPING_NAMES[model_type])
    base = getattr(model, "transformer" if model_type == "gpt2" else _LAYOUTS[model_type].base, None)
    for module, want in ((model, expected), (base, expected_base)):
        if isinstance(module, want) and type(module).forward is want.forward:
            continue
        if isinstance(module, want):
            what = f"{type(module).__name__} overrides {want.__name__}.forward"
        else:
            what = f"{type(module).__name__} is not a {want.__name__}"
        raise ValueError(
            f"causal_lm_sequential reproduces the forward of {expected.__name__} (model_type {model_type!r}), "
            f"built around {expected_base.__name__}; {what}, so the stages would not compute what the model does. "
            f"Load the model with transformers.AutoModelForCausalLM, or write the stages for this class as an "
            "nn.Sequential of its own modules"
        )


def _untie(model: nn.Module) -> None:
    head = model.get_output_embeddings()
    tied = model.get_input_embeddings().weight
    # A frozen matrix (a base under adapters) stays frozen in both places.
    head.weight = nn.Parameter(tied.detach().clone(), requires_grad=tied.requires_grad)
    model.config.tie_word_embeddings = False
    text_config = getattr(model.config, "get_text_config", None)
    if text_config is not None:
        text_config().tie_word_embeddings = False


def causal_lm_sequential(model: nn.Module, *, untie_embeddings: bool = False,
                         loss_chunk_tokens: int | None = None) -> CausalLMSequential:
    """Cut a Hugging Face ``*ForCausalLM`` into stages for :class:`~offload.OffloadModel`.

    The result takes a tensor of input ids, or a dict with ``input_ids`` and optionally
    ``attention_mask`` and ``position_ids``, and returns logits. Its modules are the model's own:
    train the ``OffloadModel`` and ``model.save_pretrained()`` writes the trained weights
    (:meth:`CausalLMSequential.hf_state_dict` renames the Sequential's keys). The slicing of
    ``OffloadModel`` balances the stages by bytes, so a slice holds whole decoder layers.

    Tied input and output embeddings (GPT-2, Gemma, SmolLM3, Cohere, some Qwen2 sizes) stay tied:
    the first slice holds the matrix and the last borrows it (Note: [Tied parameters across slices]
    in ``offload/streams/host_storage.py``). ``untie_embeddings=True`` gives the head a copy of its own
    instead, with equal values: the logits of the first forward are unchanged, but from the first
    update on the two train apart, as in a model configured with ``tie_word_embeddings=False``
    (which the config then says, so ``save_pretrained`` writes both).

    ``loss_chunk_tokens=N`` makes the head compute the loss instead of the logits, ``N`` tokens at
    a time (Note: [Chunked loss]): the batch dict must then hold ``labels`` as the model's forward
    takes them (unshifted, -100 where a token does not count; or ``shift_labels``, already
    shifted, which win over ``labels`` as in transformers), and the output is each row's sum of
    token cross-entropies, float32 of shape ``B`` (a batch without labels is refused with a
    ``TypeError``, labels that are not ``torch.long`` token ids shaped like ``input_ids`` with a
    ``ValueError``). The model's mean loss is
    ``output.sum() / CausalLMSequential.count_loss_tokens(labels)``. On the device only one
    chunk's ``N x vocab`` logits exist at a time (three tensors of that size at most, in backward),
    rather than the batch's ``B x T x vocab``; the
    price is a second projection of each chunk in backward (one more product beside the three of
    forward and backward) and rounding: the loss is the model's to float32 rounding and gradients
    to a few ulps (bit for bit where the chunk holds the whole batch), except the ``lm_head``
    gradient under a half-precision compute dtype, which autograd adds chunk by chunk in that
    precision (its error grows with the number of chunks). Chunks cut the flattened batch, so
    ``N`` is the row count of each projection's matrix product but the last: a small ``N`` trades
    speed (and that precision) for memory.

    A ``peft`` model (``peft.get_peft_model(model, LoraConfig(...))``, LoRA and the other methods
    whose adapters sit inside the model's layers) is cut as its base model with the adapters in
    place: the adapters train, the frozen base sends no gradient back, and
    ``peft_model.save_pretrained()`` writes the trained adapters (Note: [PEFT models] in
    ``offload/integrations/peft.py``).

    Args:
        model: a ``transformers`` causal LM whose ``config.model_type`` is in :data:`SUPPORTED_MODEL_TYPES`
            (the family's ``*ForCausalLM``, or a subclass that keeps its ``forward``), or a ``PeftModel`` of one.
        untie_embeddings: give a tied ``lm_head`` a weight of its own (see above).
        loss_chunk_tokens: tokens per chunk of a loss computed in the head, or ``None`` (the
            default) to return logits.

    Raises:
        ValueError: an unsupported architecture (the message lists the supported ones), a class other
            than the family's causal LM (``GPT2DoubleHeadsModel``) or one overriding its or its
            decoder's ``forward``, a PEFT method whose ``PeftModel.forward`` changes the inputs
            (prompt learning, Poly, activated LoRA), GPT-2
            with cross-attention, Gemma 3 with bidirectional attention, or a mixture of experts
            with ``output_router_logits=True`` (its load-balancing loss needs router logits the
            stages do not return); ``loss_chunk_tokens`` not a positive int, or given for a model
            whose ``loss_function`` is not transformers' ``ForCausalLMLoss``.

    Example::

        hf = transformers.AutoModelForCausalLM.from_pretrained(path)
        model = OffloadModel(causal_lm_sequential(hf), device="cuda", num_slices=8, compute_dtype=torch.bfloat16)
        logits = model({"input_ids": ids, "attention_mask": mask})
        loss = hf.loss_function(logits=logits, labels=labels, vocab_size=hf.config.vocab_size)

        layers = causal_lm_sequential(hf, loss_chunk_tokens=1024)  # no B x T x vocab logits on the device
        model = OffloadModel(layers, device="cuda", num_slices=8, compute_dtype=torch.bfloat16)
        sums = model({"input_ids": ids, "attention_mask": mask, "labels": labels})
        loss = sums.sum() / layers.count_loss_tokens(labels)
    """
    peft_base = peft_base_model(model)
    if peft_base is not None:
        model = peft_base  # Note: [PEFT models]
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not hasattr(model, "lm_head"):
        raise ValueError(
            f"causal_lm_sequential supports the causal LMs (*ForCausalLM) of {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"got {type(model).__name__} (model_type {model_type!r}). For another architecture, write the stages "
            "as an nn.Sequential of its own modules (see this module's source for the pattern)"
        )
    _check_classes(model)
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) is not supported: its blocks need "
                         "encoder states the stages do not carry")
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{type(model).__name__} with output_router_logits=True is not supported: its loss adds a load-balancing "
            "term computed from every layer's router logits, which the stages do not return. Set "
            "config.output_router_logits = False to train on the language-modelling loss alone"
        )
    if model_type == "gemma3_text" and config.use_bidirectional_attention:
        # The decoder then widens both masks with functions of its own, which the stages do not rebuild.
        raise ValueError("Gemma 3 with use_bidirectional_attention=True (an encoder, not a causal LM) is not supported")
    if loss_chunk_tokens is not None:
        if isinstance(loss_chunk_tokens, bool) or not isinstance(loss_chunk_tokens, int) or loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be a positive number of tokens or None, "
                             f"got {loss_chunk_tokens!r}")
        # What model.loss_function would return, read without calling the property: it logs a
        # warning for a loss_type of None (GPT-2's) before falling back to ForCausalLMLoss.
        loss = getattr(model, "_loss_function", None) or LOSS_MAPPING.get(getattr(model, "loss_type", None),
                                                                          ForCausalLMLoss)
        if loss is not ForCausalLMLoss:
            raise ValueError(f"loss_chunk_tokens computes transformers' ForCausalLMLoss; this model's loss_function "
                             f"is {getattr(loss, '__name__', loss)!r}. Compute that loss from the logits instead")
    if untie_embeddings and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        _untie(model)
    return CausalLMSequential(_stages(model, loss_chunk_tokens), model, loss_chunk_tokens)

