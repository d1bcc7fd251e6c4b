"""PEFT models (LoRA and the other adapter methods of ``peft``) as ``causal_lm_sequential`` takes them.

``peft`` is never imported here: a ``PeftModel`` exists only once the user imported ``peft``, so
the classes are looked up in ``sys.modules``.

Note: [PEFT models]
    1. ``peft.get_peft_model(hf, LoraConfig(...))`` returns a ``PeftModel`` around a tuner
       (``LoraModel``) around the Hugging Face model, whose linear layers (embeddings, whatever the
       config targets) are replaced in place by adapter layers holding the frozen base layer and
       the trainable adapter weights. For these methods ``PeftModel.forward`` only calls the Hugging
       Face model's forward: the adapters run inside the model's own modules, so stages cut from
       that model reproduce the ``PeftModel`` bit for bit and train its adapters, and
       ``peft_model.save_pretrained`` writes them. :func:`peft_base_model` finds that model.
    2. Methods whose ``PeftModel.forward`` does more are refused: prompt learning (virtual tokens
       or a key/value cache before the model), Poly (``task_ids``), activated LoRA (offsets
       computed from the input ids), AdaLoRA with ``orth_reg_weight`` above 0 (its tuner's forward
       adds the adapters' orthogonality penalty to the loss; with ``orth_reg_weight=0`` it adds
       zero, and training, ``update_and_allocate`` included, is the ``PeftModel``'s bit for bit),
       and SHADOW (hooks on the model's forward run a shadow network beside the decoder layers). So are
       methods whose layers share tensors across slices: VeRA, PVeRA and RandLoRA register one
       pair of frozen random projections in every adapted layer, and a buffer lives in one slice;
       and trainable tokens (``trainable_token_indices``) on a tied embedding, whose wrappers of the
       embedding and of ``lm_head`` share one buffer of token indices (untying afterwards keeps it
       shared). Every adapter the model holds is checked, active or not: ``set_adapter`` registers
       nothing new, so an adapter switched on later would run unseen (:func:`refuse_peft_methods`).
    3. Cutting the ``PeftModel`` itself cannot work by attribute: ``PeftModel.__getattr__`` forwards
       to the tuner, whose ``model`` is the ``*ForCausalLM``, not its decoder, which is what a
       Llama-layout family's ``model`` attribute is.
    4. A frozen parameter (``requires_grad=False``: the base) gets no gradient from the slices'
       backward, so it sends nothing back to the host, takes no room in the gradient buffers, and
       an optimizer never sees a gradient for it. Backward stops at the first slice that has a
       trainable parameter (when the input needs no gradient), so leading frozen slices (the
       embeddings) are neither reloaded nor recomputed. Loads are unchanged: every forward loads
       every slice, and the host copies (with their shadow under a compute dtype) stay.
    5. Adapters injected after ``OffloadModel`` was built (``get_peft_model`` on the Hugging Face
       model the stages were cut from) are new modules inside the slices' layers: the next forward
       sees the changed registrations and lays the slices out again (``SliceStorage.registered_tensors_changed``).
       The embedding stage and the head hold the token embedding and ``lm_head`` themselves, and
       PEFT replaces those (a LoRA layer, a ``modules_to_save`` copy) by ``setattr`` on their Hugging
       Face parent: every module a stage holds follows what the model holds at its place
       (``_Replacements`` in ``transformers_stages.py``), so the stages run, and the slices lay out,
       the new ones. ``load_causal_lm`` followed by ``get_peft_model`` (``offload-finetune --model``) is this case.
       Rule 2 holds for them too: the stages carry :class:`PeftRefusals` (their ``check_layout``), which
       the engine calls before each layout (a forward that lays nothing out pays nothing for it), and
       before anything moves, so a refused method injected after wrapping (an activated
       LoRA or an AdaLoRA with its penalty, which would train silently wrong; VeRA, whose shared buffer
       the layout would refuse without naming the method) gets the message wrapping gives.
    6. ``OffloadedCausalLM(peft_model).state_dict()`` holds the Hugging Face model's names
       (``model.layers.0...``), which ``peft_model.get_base_model()`` loads; the ``PeftModel`` names
       the same tensors ``base_model.model.model.layers.0...``. Its ``load_state_dict`` takes
       those names too (:func:`peft_names_as_hf`), so a checkpoint of the plain ``PeftModel``
       loads into it; a ``PeftModel`` does not take the Hugging Face names.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn


def peft_base_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face model inside a PEFT model, with the adapters in place, or ``None`` when
    ``model`` is not a PEFT model.

    Accepts a ``PeftModel`` (``peft.get_peft_model``, ``PeftModel.from_pretrained``) and the tuner
    it holds (``peft_model.base_model``, a ``LoraModel`` say).

    Raises:
        ValueError: an adapter, active or not, of a method whose ``PeftModel.forward`` does more
            than call the model: the prompt-learning methods (prompt tuning, prefix tuning,
            P-tuning, ...), which prepend virtual tokens or a key/value cache; Poly, which needs
            ``task_ids``; activated LoRA
            (``alora_invocation_tokens``), which computes offsets from the input ids; AdaLoRA with
            ``orth_reg_weight`` above 0, which adds a penalty to the loss; SHADOW, whose hooks run a
            shadow network beside the layers. Or one whose layers share buffers (VeRA, PVeRA,
            RandLoRA). Note: [PEFT models], rule 2.
    """
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    tuner_class = getattr(getattr(peft, "tuners", None), "tuners_utils", None)
    tuner_class = getattr(tuner_class, "BaseTuner", None)
    if isinstance(model, peft.PeftModel):
        configs = list(model.peft_config.values())
        if any(config.is_prompt_learning for config in configs):
            kind = ", ".join(sorted({str(config.peft_type.value) for config in configs}))
            raise ValueError(
                f"causal_lm_sequential cannot cut a PeftModel with a prompt-learning adapter ({kind}): its forward "
                "adds virtual tokens or a key/value cache before the model runs, which the stages do not. Adapter "
                "methods that live inside the model's layers (LoRA, DoRA, IA3, LoHa, LoKr, ...) are supported"
            )
        tuner = model.base_model
    elif tuner_class is not None and isinstance(model, tuner_class):
        tuner = model
    else:
        return None
    _refuse(tuner.peft_config)
    return tuner.model


def refuse_peft_methods(hf_model: nn.Module) -> None:
    """Refuse the PEFT adapters in ``hf_model`` (a Hugging Face model, PEFT's adapters injected or
    not) that the stages cannot run: every adapter its ``peft_config`` holds, active or not, and
    trainable tokens on a tied embedding (Note: [PEFT models], rule 2). Cheap: it reads the configs
    and, on a tied model, the modules of ``lm_head``.

    Raises:
        ValueError: as :func:`peft_base_model`, or for trainable tokens on a tied embedding.
    """
    if sys.modules.get("peft") is None:
        return
    # PEFT's tuners set it on the model they inject into, the same dict as the PeftModel's.
    configs = hf_model.__dict__.get("peft_config")
    if isinstance(configs, Mapping):
        _refuse(configs)
    if not getattr(getattr(hf_model, "config", None), "tie_word_embeddings", False):
        return
    from peft.tuners.trainable_tokens import TrainableTokensLayer

    output = hf_model.get_output_embeddings()
    if output is not None and any(isinstance(module, TrainableTokensLayer) for module in output.modules()):
        raise ValueError(
            "PEFT's trainable tokens (trainable_token_indices) on a model with tied embedding and lm_head share one "
            "buffer of token indices between the first slice and the last, which the stages cannot hold. "
            "Train the whole embedding instead (LoraConfig(modules_to_save=['embed_tokens'], ...): the tied "
            "lm_head trains with it), or use a model whose config has tie_word_embeddings=False")


class PeftRefusals:
    """Rule 2 of Note: [PEFT models] for adapters injected after wrapping (rule 5): a stage's
    ``check_layout``, which the engine calls before it lays the slices out again.

    Holds the Hugging Face model, so that a copy or a pickle of the stages checks its own copy of it.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        self.hf_model = hf_model

    def __call__(self) -> None:
        refuse_peft_methods(self.hf_model)


def peft_names_as_hf(peft_model: nn.Module | None, hf_model: nn.Module, state_dict: dict[str, Any], prefix: str,
                     hf_names: Iterable[str]) -> None:
    """Rename, in ``state_dict``, each key ``prefix`` + the ``PeftModel``'s name of a tensor
    (``base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight``) to ``prefix`` + its
    name in the Hugging Face model ``hf_model`` (``model.layers.0...``), where ``state_dict`` does
    not hold that name already (Note: [PEFT models], rule 6). Does nothing without ``peft_model``.

    Args:
        peft_model: the ``PeftModel`` (or tuner) holding ``hf_model``, or ``None``.
        hf_model: the Hugging Face model the stages were cut from.
        state_dict: a load's state dict, changed in place.
        prefix: where the model sits in the module that is loading (``""`` at the top).
        hf_names: the Hugging Face names of every key the model saves.
    """
    if peft_model is None:
        return
    inner = next((name for name, module in peft_model.named_modules() if module is hf_model), "")
    if not inner:
        return
    for name in hf_names:
        given = f"{prefix}{inner}.{name}"
        if given in state_dict and prefix + name not in state_dict:
            state_dict[prefix + name] = state_dict.pop(given)


#: Methods whose layers share one pair of frozen random projections (a ``BufferDict`` registered in
#: every adapted layer): a buffer must sit in one slice, and the stages cut the layers apart.
_SHARED_PROJECTIONS = {"VERA": "VeRA", "PVERA": "PVeRA", "RANDLORA": "RandLoRA"}


def _refusal(config: Any) -> str | None:
    """What ``config``'s method does that the stages cannot, and what to use instead; ``None`` when
    its adapters live inside the model's layers alone (Note: [PEFT models], rule 2)."""
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind == "POLY":
        return "a Poly adapter: its forward needs task_ids, which the stages do not carry"
    if getattr(config, "alora_invocation_tokens", None):
        return ("an activated LoRA (alora_invocation_tokens): its forward computes where the adapter starts from the "
                "input ids, which the stages do not. Use a LoRA without alora_invocation_tokens")
    if kind == "ADALORA" and config.orth_reg_weight != 0:
        return (f"an AdaLoRA adapter whose orth_reg_weight is {config.orth_reg_weight}: its forward adds that times "
                "an orthogonality penalty over the adapters to the loss, which the stages do not compute. Pass "
                "AdaLoraConfig(orth_reg_weight=0) to train without the penalty, or use LoRA (LoraConfig)")
    if kind == "SHADOW":
        return ("a SHADOW adapter: hooks on the model's forward run its shadow network beside the decoder layers, "
                "which the stages call one by one without those hooks (the shadow would get no input and no "
                "gradient). Use LoRA (LoraConfig) or another method whose adapters live inside the layers (DoRA, "
                "IA3, LoHa, LoKr, OFT)")
    if kind in _SHARED_PROJECTIONS:
        return (f"a {_SHARED_PROJECTIONS[kind]} adapter: every adapted layer holds the same frozen random "
                "projections (one buffer shared by all of them), and the stages cut the layers into slices that "
                "each hold their own tensors. Use LoRA (LoraConfig) or another method whose adapters are each "
                "layer's own (DoRA, IA3, LoHa, LoKr, OFT)")
    return None


def _refuse(configs: Mapping[str, Any]) -> None:
    """Raise for the first of ``configs`` (adapter name -> config) whose method the stages cannot run."""
    for name, config in configs.items():
        refusal = _refusal(config)
        if refusal is not None:
            raise ValueError(f"causal_lm_sequential cannot cut a PeftModel with {refusal}. This holds for the adapter "
                             f"{name!r} active or not (set_adapter would switch it on unseen); "
                             f"delete_adapter({name!r}) removes it")
