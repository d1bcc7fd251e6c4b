"""Where each Hugging Face causal LM family's forward departs from Llama's: the families
:func:`~offload.integrations.transformers.causal_lm_sequential` cuts, and for each a :class:`_Layout`
(an embedding multiplier, a mask or rotary table per layer type, a scale or soft-cap on the
logits...); and the model types that transformers builds as one of those families' classes.

It holds data only: the stages that follow a layout are in ``transformers_layers.py``, the cut that
picks one in ``transformers_stages.py``. It needs no ``transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    #: (``config.layer_types[i]`` says which layer ``i`` gets: causal, sliding, chunked or recurrent).
    mask: Literal["causal", "sliding_window", "layer_types"] = "causal"
    #: The decoder builds its masks from the position ids (packed sequences then attend apart); a
    #: decoder that builds them without gets them built without.
    mask_from_positions: bool = True
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
    "ernie4_5": _Layout(),
    "cohere2": _Layout(mask="layer_types", logit_scale=True),
    "seed_oss": _Layout(),
    "exaone4": _MASK_PER_LAYER_TYPE,
    "arcee": _Layout(),
    "apertus": _Layout(),
    "hunyuan_v1_dense": _Layout(),
    "nemotron": _Layout(),
    "bitnet": _Layout(),
    "lfm2": _Layout(final_norm="embedding_norm", mask="layer_types"),  # its convolution layers' type is "conv"
    # Classes of their own (transformers 5.24) whose forward is, statement for statement, their
    # model's: VaultGemma's Gemma 2's, Ministral 3's Mistral's, the others Llama's.
    "vaultgemma": _Layout(mask="layer_types", layers_take_use_cache=False, final_logit_softcapping=True),
    "ministral3": _Layout(mask="sliding_window"),
    "diffllama": _Layout(),  # its differential attention is inside the layers
    "jais2": _Layout(),
    "youtu": _Layout(),  # multi-head latent attention inside the layers
    # Mixture of experts: the routing happens inside the layers; the load-balancing loss is refused
    # (``transformers_stages.py``).
    "mixtral": _Layout(mask="sliding_window"),
    "qwen2_moe": _MASK_PER_LAYER_TYPE,
    "qwen3_moe": _Layout(mask="sliding_window"),
    "gpt_oss": _Layout(mask="layer_types", mask_from_positions=False),
    "deepseek_v3": _Layout(),
    "deepseek_v2": _Layout(),
    "olmoe": _Layout(),
    "granitemoe": _Layout(embedding_multiplier=True, logits_scaling=True),
    "granitemoeshared": _Layout(embedding_multiplier=True, logits_scaling=True),
    "glm4_moe": _Layout(),
    "dots1": _MASK_PER_LAYER_TYPE,
    "llama4_text": _MASK_PER_LAYER_TYPE,  # chunked and full attention layers
    "phimoe": _Layout(mask="sliding_window"),
    "jetmoe": _Layout(),
    "qwen3_next": _MASK_PER_LAYER_TYPE,  # linear and full attention layers
    # Classes of their own (transformers 5.24) whose forward is, statement for statement, their
    # model's: GLM-4-MoE-Lite's and Solar Open's GLM-4-MoE's, Aria text's and A.X K1's DeepSeek-V3's,
    # ERNIE 4.5 MoE's and FlexOlmo's OLMoE's (with its load-balancing loss), EXAONE-MoE's dots.llm1's,
    # Flint's Qwen2-MoE's (with its loss).
    "glm4_moe_lite": _Layout(),
    "solar_open": _Layout(),
    "aria_text": _Layout(),
    "axk1": _Layout(),
    "ernie4_5_moe": _Layout(),
    "flex_olmo": _Layout(),
    "exaone_moe": _MASK_PER_LAYER_TYPE,
    "flint": _MASK_PER_LAYER_TYPE,
}
#: The ``config.model_type`` values of the families this module cuts. Others share parts of the layout but
#: differ in details that change results (embedding dropout outside a module, positions as attention
#: biases, router losses), or have not been checked, so they are refused rather than approximated.
SUPPORTED_MODEL_TYPES = ("gpt2", *_LAYOUTS)
#: Model types with a config class of their own that ``AutoModelForCausalLM`` builds as one family's
#: ``*ForCausalLM`` (transformers 5.23 on: internlm3, iquestcoder; 5.24 on: the others), so the model
#: computes that family's forward and is cut with its layout. The cut checks that the model is of that
#: family's class (a checkpoint's own remote code is not); each is checked bit for bit as the families are.
#: A model type that a later release builds as a family's class is refused until it is added here.
_BUILT_AS_FAMILY = {"exaone": "llama", "internlm3": "llama", "iquestcoder": "llama", "sarvam_mla": "deepseek_v3",
                    "sarvam_moe": "glm4_moe"}
# Found by the model's own type wherever a layout is looked up (the cut, the wrapper's checks).
_LAYOUTS.update({kind: _LAYOUTS[family] for kind, family in _BUILT_AS_FAMILY.items()})
#: Every ``config.model_type`` the cut takes: the families' and those built as one of their classes.
CUT_MODEL_TYPES = (*SUPPORTED_MODEL_TYPES, *_BUILT_AS_FAMILY)
