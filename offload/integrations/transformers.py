"""Hugging Face causal language models as an ``nn.Sequential`` that :class:`~offload.OffloadModel` can wrap.

:func:`causal_lm_sequential` cuts a ``transformers`` ``*ForCausalLM`` (GPT-2, and the Llama
decoder layout: Llama, Mistral, Qwen2, Qwen3) into stages built around the model's *own*
submodules: an embedding stage, one stage per decoder layer and a head stage (final norm and
``lm_head``). Nothing is copied, so the Hugging Face model trains along: its ``state_dict()`` and
``save_pretrained()`` hold the trained weights. The stages reproduce the model's forward
operation for operation, so logits are bit-identical to the model's own, in train mode with
dropout and in eval mode, with padding and attention masks, with
``gradient_checkpointing_enable()``, and under ``compute_dtype``.

What travels between stages is ``(hidden_states, attention_mask, position_ids, position_embeddings)``:
the 2-D attention mask as the user passed it (or ``None``) rather than the 4-D mask, which each
decoder stage rebuilds with the model's own mask function, because a ``B x 1 x T x T`` mask at every
slice boundary would be checkpointed to the host once per slice; rotary tables (``T x head_dim``)
are small and computed once. None of them requires grad, exactly as in the model (Note: [Boundary
gradients] in ``offload/autograd/function.py``).

This module holds the adapters only; it does not train, load weights or tokenize.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

try:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        'offload.integrations.transformers needs Hugging Face transformers 5: pip install "offload[transformers]"'
    ) from error

__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLMSequential", "causal_lm_sequential"]

#: ``config.model_type`` values this module can cut. Others share parts of the layout but differ in
#: details that change results (embedding scales, residual multipliers, soft-capping), so they are
#: refused rather than approximated.
SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")

#: Keys a batch dict may hold. Labels are refused on purpose: the stages return logits, and a
#: silently ignored ``labels`` would look like a loss that is never computed.
_BATCH_KEYS = ("input_ids", "attention_mask", "position_ids")

_State = tuple[torch.Tensor, "torch.Tensor | None", torch.Tensor, Any]


def _unpack_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch, None, None
    if isinstance(batch, Mapping):
        unknown = sorted(set(batch) - set(_BATCH_KEYS))
        if unknown or "input_ids" not in batch:
            raise TypeError(
                f"the batch must be input ids, or a dict with 'input_ids' and optionally 'attention_mask' and "
                f"'position_ids'; got keys {sorted(batch)}. The model returns logits: compute the loss from them "
                "(hf_model.loss_function(logits=logits, labels=labels, vocab_size=hf_model.config.vocab_size))"
            )
        return batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids")
    raise TypeError(
        f"the batch must be a tensor of input ids or a dict of tensors, not {type(batch).__name__} (a tokenizer's "
        "BatchEncoding: pass dict(batch))"
    )


def _default_positions(hidden: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    # As the models do without a cache: positions 0..T-1, one row shared by the batch.
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class LlamaEmbedding(nn.Module):
    """Token embedding and rotary tables of a Llama-layout model (its own ``embed_tokens`` and ``rotary_emb``)."""

    def __init__(self, embed_tokens: nn.Embedding, rotary_emb: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb

    def forward(self, batch: Any) -> _State:
        input_ids, attention_mask, position_ids = _unpack_batch(batch)
        hidden = self.embed_tokens(input_ids)
        position_ids = _default_positions(hidden, position_ids)
        return hidden, attention_mask, position_ids, self.rotary_emb(hidden, position_ids=position_ids)


class GPT2Embedding(nn.Module):
    """GPT-2's token and position embeddings and their dropout (its own ``wte``, ``wpe``, ``drop``)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Dropout) -> None:
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop

    def forward(self, batch: Any) -> _State:
        input_ids, attention_mask, position_ids = _unpack_batch(batch)
        batch_size = input_ids.shape[0]
        input_ids = input_ids.view(-1, input_ids.shape[-1])
        hidden = self.wte(input_ids)
        position_ids = _default_positions(hidden, position_ids)
        hidden = self.drop(hidden + self.wpe(position_ids))
        if attention_mask is not None and attention_mask.ndim < 4:
            attention_mask = attention_mask.view(batch_size, -1)
        return hidden, attention_mask, position_ids, None


class DecoderLayer(nn.Module):
    """One of the model's decoder layers, called as the model calls it, with its attention mask
    rebuilt from the 2-D mask by the model's mask function for that layer."""

    def __init__(self, layer: nn.Module, config: Any, mask_function: Callable[..., Any], gpt2: bool) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        self.mask_function = mask_function
        self.gpt2 = gpt2

    def forward(self, state: _State) -> _State:
        hidden, attention_mask, position_ids, position_embeddings = state
        mask = self.mask_function(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask,
                                  past_key_values=None, position_ids=position_ids)
        if self.gpt2:
            # Positional as GPT2Model passes them (past_key_values, attention_mask, encoder_hidden_states).
            hidden = self.layer(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False,
                                position_ids=position_ids)
        else:
            hidden = self.layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=None,
                                use_cache=False, position_embeddings=position_embeddings)
        return hidden, attention_mask, position_ids, position_embeddings


class Head(nn.Module):
    """The final norm and the output projection (the model's own ``norm``/``ln_f`` and ``lm_head``); returns logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, state: _State) -> torch.Tensor:
        return self.lm_head(self.norm(state[0]))


class CausalLMSequential(nn.Sequential):
    """The stages of a causal LM, with the way back to the Hugging Face parameter names.

    Attributes:
        hf_model: the model the stages were cut from (sharing every module with it).
    """

    def __init__(self, stages: list[nn.Module], hf_model: nn.Module) -> None:
        super().__init__(*stages)
        # Not a submodule: the stages already hold its modules, and registering it would list
        # every parameter twice.
        object.__setattr__(self, "hf_model", hf_model)
        names = {id(module): name for name, module in hf_model.named_modules()}
        #: this Sequential's module name -> the Hugging Face model's, for every module of a stage
        self._hf_names = {name: names[id(module)] for name, module in self.named_modules()
                          if name and id(module) in names}

    def hf_name(self, key: str) -> str:
        """The Hugging Face name of a ``state_dict`` key of this Sequential, or of an ``OffloadModel`` wrapping it.

        Raises:
            KeyError: ``key`` names no parameter or buffer of a stage.
        """
        module, _, leaf = key.rpartition(".")
        if module not in self._hf_names:
            raise KeyError(f"{key!r} is not a parameter or buffer of these stages")
        return f"{self._hf_names[module]}.{leaf}" if self._hf_names[module] else leaf

    def hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` (of this Sequential or of an ``OffloadModel`` wrapping it) under Hugging Face names."""
        return {self.hf_name(key): value for key, value in state_dict.items()}


def _llama_mask_function(config: Any, index: int) -> Callable[..., Any]:
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:  # Qwen2, Qwen3: a mask per layer kind
        sliding = kinds[index] == "sliding_attention"
    else:  # Mistral's rule: one kind for every layer
        sliding = getattr(config, "sliding_window", None) is not None
    return create_sliding_window_causal_mask if sliding else create_causal_mask


def _stages(model: nn.Module) -> list[nn.Module]:
    config = model.config
    if config.model_type == "gpt2":
        base = model.transformer
        blocks = [DecoderLayer(block, config, create_causal_mask, gpt2=True) for block in base.h]
        return [GPT2Embedding(base.wte, base.wpe, base.drop), *blocks, Head(base.ln_f, model.lm_head)]
    base = model.model
    layers = list(base.layers[:config.num_hidden_layers])
    blocks = [DecoderLayer(layer, config, _llama_mask_function(config, i), gpt2=False) for i, layer in enumerate(layers)]
    return [LlamaEmbedding(base.embed_tokens, base.rotary_emb), *blocks, Head(base.norm, model.lm_head)]


def _untie(model: nn.Module) -> None:
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    text_config = getattr(model.config, "get_text_config", None)
    if text_config is not None:
        text_config().tie_word_embeddings = False


def causal_lm_sequential(model: nn.Module, *, untie_embeddings: bool = False) -> CausalLMSequential:
    """Cut a Hugging Face ``*ForCausalLM`` into stages for :class:`~offload.OffloadModel`.

    The result takes a tensor of input ids, or a dict with ``input_ids`` and optionally
    ``attention_mask`` and ``position_ids``, and returns logits. Its modules are the model's own:
    train the ``OffloadModel`` and ``model.save_pretrained()`` writes the trained weights
    (:meth:`CausalLMSequential.hf_state_dict` renames the Sequential's keys). The slicing of
    ``OffloadModel`` balances the stages by bytes, so a slice holds whole decoder layers.

    Tied input and output embeddings (GPT-2, some Qwen2 sizes) stay tied: the first slice holds the
    matrix and the last borrows it (Note: [Tied parameters across slices] in
    ``offload/streams/host_storage.py``). ``untie_embeddings=True`` gives the head a copy of its own
    instead, with equal values: the logits of the first forward are unchanged, but from the first
    update on the two train apart, as in a model configured with ``tie_word_embeddings=False``
    (which the config then says, so ``save_pretrained`` writes both).

    Args:
        model: a ``transformers`` causal LM whose ``config.model_type`` is in :data:`SUPPORTED_MODEL_TYPES`.
        untie_embeddings: give a tied ``lm_head`` a weight of its own (see above).

    Raises:
        ValueError: an unsupported architecture (the message lists the supported ones), or GPT-2
            with cross-attention.

    Example::

        hf = transformers.AutoModelForCausalLM.from_pretrained(path)
        model = OffloadModel(causal_lm_sequential(hf), device="cuda", num_slices=8, compute_dtype=torch.bfloat16)
        logits = model({"input_ids": ids, "attention_mask": mask})
        loss = hf.loss_function(logits=logits, labels=labels, vocab_size=hf.config.vocab_size)
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or not hasattr(model, "lm_head"):
        raise ValueError(
            f"causal_lm_sequential supports the causal LMs (*ForCausalLM) of {', '.join(SUPPORTED_MODEL_TYPES)}; "
            f"got {type(model).__name__} (model_type {model_type!r}). For another architecture, write the stages "
            "as an nn.Sequential of its own modules (see this module's source for the pattern)"
        )
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) is not supported: its blocks need "
                         "encoder states the stages do not carry")
    if untie_embeddings and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        _untie(model)
    return CausalLMSequential(_stages(model), model)
