"""Hugging Face causal language models as an ``nn.Sequential`` that :class:`~offload.OffloadModel` can wrap.

:func:`causal_lm_sequential` cuts a ``transformers`` ``*ForCausalLM`` (GPT-2, and the families
built on the Llama decoder layout, ``SUPPORTED_MODEL_TYPES``: Llama, Mistral, Qwen, Gemma, Phi,
OLMo, Granite, Cohere, GLM, DeepSeek, GPT-OSS and others, dense and mixtures of experts) into
stages built around the model's *own* submodules: an embedding stage, one stage per decoder layer
and a head stage (final norm and ``lm_head``). Nothing is copied, so the Hugging Face model trains
along: its ``state_dict()`` and ``save_pretrained()`` hold the trained weights. The stages reproduce the
model's forward operation for operation, so logits are bit-identical to the model's own, in train
mode with dropout and in eval mode, with padding and attention masks, with
``gradient_checkpointing_enable()``, and under ``compute_dtype``. Where a family's forward departs
from Llama's (an embedding multiplier, a mask or rotary table per layer type, a scale or soft-cap
on the logits), a :class:`_Layout` says so (``transformers_families.py``) and the stages
(``transformers_layers.py``) do the same step in the same place. What travels between
the stages is described in ``transformers_batch.py``.

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

This module holds the cut (:func:`causal_lm_sequential`, :class:`CausalLMSequential`): which
stages a model gets, and the checks that refuse a model the stages would not reproduce. It does not
train, load weights or tokenize. Users import it through
``offload.integrations.transformers``, which adds loading and the trainers' model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..streams.watched_hooks import WatchedHooks
from . import install_hint
from .peft import PeftRefusals, peft_base_model, refuse_peft_methods
from .transformers_batch import IGNORE_INDEX
from .transformers_families import _BUILT_AS_FAMILY, _LAYOUTS, CUT_MODEL_TYPES, SUPPORTED_MODEL_TYPES, _Layout
from .transformers_layers import DecoderLayer, GPT2Embedding, Head, LlamaEmbedding
from .transformers_masks import _MaskCache
from .transformers_router import RouterCapture, RouterLoss, refuse_unasked_router_loss, router_loss_of

try:
    import transformers
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.masking_utils import (
        create_causal_mask,
        create_chunked_causal_mask,
        create_recurrent_attention_mask,
        create_sliding_window_causal_mask,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        f"offload.integrations.transformers needs Hugging Face transformers 5: {install_hint('transformers')}"
    ) from error

__all__ = ["CausalLMSequential", "causal_lm_sequential"]


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
        _follow_replacements(self, hf_model)

    def _module_names(self) -> dict[str, str]:
        names = {id(module): name for name, module in self.hf_model.named_modules()}
        return {name: names[id(module)] for name, module in self.named_modules() if name and id(module) in names}

    def hf_name(self, key: str) -> str:
        """The Hugging Face name of a ``state_dict`` key of this Sequential, or of an ``OffloadModel`` wrapping it.

        A key may name what a module saves below one of its tensors: a bitsandbytes ``Linear4bit``
        saves its quantisation state as ``weight.absmax``, ``weight.quant_map``,
        ``weight.quant_state.bitsandbytes__nf4``; those keep that tail under the module's name.

        Raises:
            KeyError: ``key`` names no parameter or buffer of a stage, nor what a module saves below one.
        """
        module, _, leaf = key.rpartition(".")
        found = (module, leaf) if module in self._hf_names else self._below_a_tensor(key)
        if found is None:
            self._hf_names = self._module_names()  # modules added since, adapters say
            found = (module, leaf) if module in self._hf_names else self._below_a_tensor(key)
        if found is None:
            raise KeyError(f"{key!r} is not a parameter or buffer of these stages")
        module, leaf = found
        return f"{self._hf_names[module]}.{leaf}" if self._hf_names[module] else leaf

    def _below_a_tensor(self, key: str) -> tuple[str, str] | None:
        """``key`` split into a module of the stages and the tail below one of that module's own
        parameters or buffers (``"weight.absmax"``), for :meth:`hf_name`; ``None`` if it is not such a key."""
        parts = key.split(".")
        for end in range(len(parts) - 2, 0, -1):  # the longest module first; the tail has two parts or more
            module, tensor = ".".join(parts[:end]), parts[end]
            if module in self._hf_names:
                owner = self.get_submodule(module)
                if tensor in owner._parameters or tensor in owner._buffers:
                    return module, ".".join(parts[end:])
        return None

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


class _Replacements:
    """The stages' modules by their place in the Hugging Face model, so that a module set in that
    place (``setattr(parent, name, new)``) goes into the stage too (Note: [PEFT models], rule 5).

    PyTorch's global module-registration hook, installed while a stage that follows lives (a
    ``WatchedHooks``, removed with the last: compiled autograd cannot trace it), sees
    every such ``setattr``; the table is keyed weakly by the parent, and holds the stages weakly,
    so a model that is gone leaves nothing behind. The cost for any other registration is one
    dictionary lookup.
    """

    #: parent module -> {attribute name -> [(stage, the stage's attribute for that module)]}
    places: weakref.WeakKeyDictionary[nn.Module, dict[str, list[tuple[weakref.ref[nn.Module], str]]]] = (
        weakref.WeakKeyDictionary())
    hook = WatchedHooks(nn.modules.module.register_module_module_registration_hook)

    @classmethod
    def follow(cls, parent: nn.Module, name: str, stage: nn.Module, attribute: str) -> None:
        followers = cls.places.setdefault(parent, {}).setdefault(name, [])
        if not any(ref() is stage and held == attribute for ref, held in followers):  # a stage cut twice
            cls.hook.watch(stage, cls._registered)
            followers.append((weakref.ref(stage), attribute))

    @classmethod
    def _registered(cls, module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        followers = cls.places.get(module)
        if followers is None or name not in followers or submodule is None:
            return
        for stage_ref, attribute in followers[name]:
            stage = stage_ref()
            if stage is not None and stage._modules.get(attribute) is not submodule:
                setattr(stage, attribute, submodule)  # registered, so the slices see it changed


class _FollowedPlaces:
    """The places a stage's modules follow, kept on the stage (``_followed_places``) so that a copy
    of it follows the copy's model: ``copy.deepcopy`` and unpickling (``torch.save(model)``) copy
    each parent with the stage, and ``__setstate__`` enters the copy's parents in
    :class:`_Replacements`, whose table no copy sees. Without it a copy's stages kept running the
    modules they were copied with after ``resize_token_embeddings``, ``set_output_embeddings`` or
    ``get_peft_model`` on the copy's model replaced them there. ``__setstate__`` reads nothing of
    the copies, whose state may still be in the making then.

    It holds its stage weakly (a strong reference would be a cycle, and a dropped model would wait
    for the garbage collector) but hands it to copies and pickles, which build it first.
    """

    def __init__(self, stage: nn.Module) -> None:
        self.stage = weakref.ref(stage)
        self.places: list[tuple[nn.Module, str, str]] = []  # (parent, name there, the stage's attribute)

    def add(self, parent: nn.Module, name: str, attribute: str) -> None:
        if not any(held is parent and place == (name, attribute) for held, *place in self.places):
            self.places.append((parent, name, attribute))
        _Replacements.follow(parent, name, self.stage(), attribute)

    def __getstate__(self) -> dict[str, Any]:
        return {"stage": self.stage(), "places": self.places}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.stage = weakref.ref(state["stage"])
        self.places = []
        for parent, name, attribute in state["places"]:
            self.add(parent, name, attribute)


def _follow_replacements(layers: nn.Sequential, hf_model: nn.Module) -> None:
    """Have every module a stage holds directly (the embedding, ``lm_head``, a decoder layer) follow
    what the Hugging Face model holds at its place: ``get_peft_model`` after the cut replaces
    ``embed_tokens`` or ``lm_head`` on their parent, which the stages would otherwise never see.
    A copy of the stages follows the copy's model (:class:`_FollowedPlaces`)."""
    places = {id(module): name for name, module in hf_model.named_modules() if name}
    for stage in layers:
        for attribute, module in stage.named_children():
            if id(module) in places:
                parent, _, name = places[id(module)].rpartition(".")
                followed = stage.__dict__.get("_followed_places")
                if followed is None:  # a plain attribute: the stage's state, which copies and pickles carry
                    followed = stage.__dict__["_followed_places"] = _FollowedPlaces(stage)
                followed.add(hf_model.get_submodule(parent), name, attribute)


#: The mask function of each ``config.layer_types`` entry, as the decoders of ``_Layout(mask="layer_types")`` pick it.
_MASK_OF_LAYER_TYPE = {
    "full_attention": create_causal_mask,
    "sliding_attention": create_sliding_window_causal_mask,
    "chunked_attention": create_chunked_causal_mask,  # Llama 4
    "conv": create_recurrent_attention_mask,  # LFM2's convolution layers
    "linear_attention": create_recurrent_attention_mask,  # Qwen3-Next's
}

#: What the layers of a type that mixes tokens by a convolution or a recurrence, not by attention, read
#: of a packed batch's sequence boundaries: the padding-free collators' keywords, which the model passes
#: to their kernels and the stages do not carry (rule 5 of Note: [What the trainers cannot get from the
#: model] in ``transformers_refusals.py``). Attention layers find the same boundaries in ``position_ids``.
_PACKED_SEQUENCE_KEYWORDS = {
    "conv": ("seq_idx",),  # LFM2's short convolution (causal_conv1d_fn)
    "linear_attention": ("seq_idx", "cu_seq_lens_q"),  # Qwen3-Next's convolution and gated delta rule
}


def packed_sequence_keywords(config: Any) -> dict[str, str]:
    """The forward keywords that carry packed sequences' boundaries to a layer of this model that reads
    them, each with that layer's type (``{"seq_idx": "conv"}`` for LFM2); empty for a model whose
    layers all attend, which find the boundaries in ``position_ids``."""
    keywords: dict[str, str] = {}
    for kind in getattr(config, "layer_types", None) or ():
        for keyword in _PACKED_SEQUENCE_KEYWORDS.get(kind, ()):
            keywords.setdefault(keyword, kind)
    return keywords


def _mask_function(layout: _Layout, config: Any, index: int) -> Callable[..., Any]:
    if layout.mask == "layer_types":
        kind = config.layer_types[index]
        if kind not in _MASK_OF_LAYER_TYPE:
            raise ValueError(
                f"{config.model_type}: layer {index} is of type {kind!r}, whose attention mask the stages do not "
                f"build (they build {', '.join(sorted(_MASK_OF_LAYER_TYPE))}); this model cannot be cut")
        return _MASK_OF_LAYER_TYPE[kind]
    if layout.mask == "sliding_window":
        sliding = config.sliding_window is not None
    else:
        sliding = False
    return create_sliding_window_causal_mask if sliding else create_causal_mask


def _stages(model: nn.Module, loss_chunk_tokens: int | None, router: RouterLoss | None) -> list[nn.Module]:
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
        with_labels=with_labels, router_logits=router is not None)
    blocks = [DecoderLayer(layer, config, _mask_function(layout, config, i), layout,
                           layer_type=config.layer_types[i] if per_type else None, masks=masks,
                           routers=None if router is None else RouterCapture(layer, router.routers))
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
    A model type built as a family's class (``_BUILT_AS_FAMILY``) must be of that family's classes, the
    ones its layout follows, whatever class a checkpoint's remote code or another release builds for it.
    """
    model_type = model.config.model_type
    family = _BUILT_AS_FAMILY.get(model_type, model_type)
    expected = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    expected_base = getattr(transformers, MODEL_MAPPING_NAMES[family])
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


def _refuse_model_type(model: nn.Module, model_type: Any) -> None:
    built_as = ", ".join(f"{kind} (as {family})" for kind, family in _BUILT_AS_FAMILY.items())
    got = f"got {type(model).__name__} (model_type {model_type!r})"
    # A model type that transformers builds as a family's class, but whose config no one has checked
    # against that family's layout: say so, rather than seem to refuse a class the list names.
    family = next((kind for kind in SUPPORTED_MODEL_TYPES
                   if MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind) == type(model).__name__), None)
    if family is not None and hasattr(model, "lm_head"):
        got = (f"got {type(model).__name__}, {family}'s class, for model_type {model_type!r}, which has not been "
               f"checked against {family}'s layout and is refused as an unknown architecture")
    raise ValueError(
        f"causal_lm_sequential supports the causal LMs (*ForCausalLM) of {', '.join(SUPPORTED_MODEL_TYPES)}, and "
        f"the model types built as one of their classes: {built_as}; {got}. For another architecture, write the "
        "stages as an nn.Sequential of its own modules (see this module's source for the pattern)")


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
                         loss_chunk_tokens: int | None = None, router_logits: bool | None = False) -> CausalLMSequential:
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

    ``router_logits=True`` (a mixture of experts whose family adds a load-balancing loss: Mixtral,
    Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS, Granite-MoE, PhiMoE, JetMoE, Qwen3-Next) lets a batch
    dict hold ``"output_router_logits": True``: the output is then ``(output, *router_logits)``,
    one ``B x T x experts`` tensor per router call, in the model's order; reshaped to ``B*T x
    experts`` they are what the model returns, for its family's ``load_balancing_loss_func``
    (Note: [Router logits] in ``transformers_router.py``; :class:`~.causal_lm.OffloadedCausalLM`
    adds the loss as the model does).

    A ``peft`` model (``peft.get_peft_model(model, LoraConfig(...))``, LoRA and the other methods
    whose adapters sit inside the model's layers) is cut as its base model with the adapters in
    place: the adapters train, the frozen base sends no gradient back, and
    ``peft_model.save_pretrained()`` writes the trained adapters (Note: [PEFT models] in
    ``offload/integrations/peft.py``).

    Args:
        model: a ``transformers`` causal LM whose ``config.model_type`` is in :data:`SUPPORTED_MODEL_TYPES`
            (the family's ``*ForCausalLM``, or a subclass that keeps its ``forward``), or is a model type
            transformers builds as one of those families' classes (EXAONE 3, InternLM3, IQuest-Coder as
            ``LlamaForCausalLM``, Sarvam-MLA as ``DeepseekV3ForCausalLM``, Sarvam-MoE as ``Glm4MoeForCausalLM``),
            or a ``PeftModel`` of one.
        untie_embeddings: give a tied ``lm_head`` a weight of its own (see above).
        loss_chunk_tokens: tokens per chunk of a loss computed in the head, or ``None`` (the
            default) to return logits.
        router_logits: let a batch ask for the router logits (see above); ``None`` where the
            family computes the loss from them, else not (what ``OffloadedCausalLM`` asks).

    Raises:
        ValueError: an unsupported architecture (the message lists the supported ones), a class other
            than the family's causal LM (``GPT2DoubleHeadsModel``) or one overriding its or its
            decoder's ``forward``, a PEFT method whose ``PeftModel.forward`` changes the inputs
            (prompt learning, Poly, activated LoRA, ...: Note: [PEFT models], rule 2), GPT-2
            with cross-attention, Gemma 3 with bidirectional attention, a mixture of experts
            with ``output_router_logits=True`` whose load-balancing loss the stages do not carry
            (without ``router_logits=True``, or a family they carry none for) or whose family adds
            none (its router logits would only be returned, the loss the same), ``router_logits=True``
            for a model whose family computes no such loss; ``loss_chunk_tokens`` not a positive
            int, or given for a model whose ``loss_function`` is not transformers' ``ForCausalLMLoss``.

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
    if model_type not in CUT_MODEL_TYPES or not hasattr(model, "lm_head"):
        _refuse_model_type(model, model_type)
    _check_classes(model)
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with cross-attention (add_cross_attention=True) is not supported: its blocks need "
                         "encoder states the stages do not carry")
    router = router_loss_of(model) if router_logits is not False else None
    if router_logits and router is None:
        raise ValueError(f"router_logits=True: {type(model).__name__} computes no load-balancing loss from router "
                         "logits that the stages can carry (Note: [Router logits]); cut it without router_logits")
    refuse_unasked_router_loss(model, router)
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
    refuse_peft_methods(model)  # before untying, which would leave trainable tokens' indices shared
    if untie_embeddings and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        _untie(model)
    layers = CausalLMSequential(_stages(model, loss_chunk_tokens, router), model, loss_chunk_tokens)
    # Adapters injected after wrapping are refused as at the cut (Note: [PEFT models], rule 5).
    layers[0].check_layout = PeftRefusals(model)
    return layers
