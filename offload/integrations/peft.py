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
       computed from the input ids).
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
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn


def peft_base_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face model inside a PEFT model, with the adapters in place, or ``None`` when
    ``model`` is not a PEFT model.

    Accepts a ``PeftModel`` (``peft.get_peft_model``, ``PeftModel.from_pretrained``) and the tuner
    it holds (``peft_model.base_model``, a ``LoraModel`` say).

    Raises:
        ValueError: a method whose ``PeftModel.forward`` changes the inputs or passes arguments the
            stages do not carry: the prompt-learning methods (prompt tuning, prefix tuning,
            P-tuning, ...), which prepend virtual tokens or a key/value cache; Poly, which needs
            ``task_ids``; activated LoRA (``alora_invocation_tokens``), which computes offsets from
            the input ids.
    """
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    tuner_class = getattr(getattr(peft, "tuners", None), "tuners_utils", None)
    tuner_class = getattr(tuner_class, "BaseTuner", None)
    if isinstance(model, peft.PeftModel):
        configs = [model.peft_config[name] for name in _names(model.active_adapters)]
        if any(config.is_prompt_learning for config in configs):
            kind = ", ".join(sorted({str(config.peft_type.value) for config in configs}))
            raise ValueError(
                f"causal_lm_sequential cannot cut a PeftModel with a prompt-learning adapter ({kind}): its forward "
                "adds virtual tokens or a key/value cache before the model runs, which the stages do not. Adapter "
                "methods that live inside the model's layers (LoRA, DoRA, IA3, LoHa, LoKr, ...) are supported"
            )
        tuner = model.base_model
    elif tuner_class is not None and isinstance(model, tuner_class):
        configs = [model.peft_config[name] for name in _names(model.active_adapters)]
        tuner = model
    else:
        return None
    for config in configs:
        kind = str(getattr(config.peft_type, "value", config.peft_type))
        if kind == "POLY":
            raise ValueError("causal_lm_sequential cannot cut a PeftModel with a Poly adapter: its forward needs "
                             "task_ids, which the stages do not carry")
        if getattr(config, "alora_invocation_tokens", None):
            raise ValueError(
                "causal_lm_sequential cannot cut a PeftModel with an activated LoRA (alora_invocation_tokens): its "
                "forward computes where the adapter starts from the input ids, which the stages do not. Use a LoRA "
                "without alora_invocation_tokens"
            )
    return tuner.model


def _names(active: Any) -> list[str]:
    return [active] if isinstance(active, str) else list(active)
