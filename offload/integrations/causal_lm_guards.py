"""What an :class:`~offload.integrations.causal_lm.OffloadedCausalLM` does about changes made around its
stages after wrapping, which its forward would not see: a module or parameter set on the wrapper and
hooks on the Hugging Face containers are refused, PEFT around the wrapper is refused, and PEFT adapters
injected into the Hugging Face model are saved as the ``PeftModel`` saves them.

What it does not hold: changes *inside* the model's layers (an adapter injected, a submodule
replaced), which the stages follow by themselves (Note: [PEFT models] in ``peft.py``, rule 5;
``_Replacements`` in ``transformers_stages.py``).

Note: [Around the stages]
    The forward runs the stages, which call the model's own layers (the embedding, each decoder layer,
    the rotary embedding, the final norm, ``lm_head``) one by one. What sits *around* them is never
    called: the wrapper's own submodules, and the containers the model's forward would go through.
    1. A module or parameter set on the wrapper (``model.lm_head = nn.Linear(...)``, a value head
       ``model.v_head = ...``) would show in ``parameters()`` and ``state_dict()`` but never run, and
       ``OffloadOptimizer`` would find parameters the OffloadModel does not hold. It is refused where it
       is set, as ``OffloadModel`` refuses a top-level layer (Note: [Layers fixed at wrapping]): the
       Hugging Face model is where a head goes (``model.hf_model.lm_head = ...`` or
       ``set_output_embeddings``, which the stages follow). Setting what a name holds already is no
       change and is let through; so is anything that is not a module or a parameter (the trainers
       and Accelerate set plain attributes, ``forward`` among them).
    2. Hooks on the containers the stages bypass: the Hugging Face model, its decoder (``hf.model``,
       GPT-2's ``hf.transformer``) and a ``PeftModel`` (and its tuner) wrapped around them. A forward
       hook there (a steering vector on the decoder's output) changes the plain model's logits and
       silently not the stages'. Every forward checks their hook dicts (forward and backward, pre and
       post: a few dictionaries) and refuses, naming the hook and where it would run. No library
       registers a lasting hook there in the setups this wrapper supports: Accelerate's
       ``add_hook_to_module`` replaces ``forward`` instead, and ``enable_input_require_grads`` and
       NEFTune hook the input embeddings, a layer the stages call. Global module hooks
       (``register_module_forward_hook``) run for the layers the stages call, as for any module.
    3. PEFT around the wrapper (``get_peft_model(OffloadedCausalLM(...))``, TRL's ``peft_config``) would
       name the adapters by the stages; its tuner's ``peft_config`` is refused where it is set.
    4. PEFT adapters injected after wrapping (``get_peft_model(model.hf_model, LoraConfig(...))``) train
       as the ``PeftModel``'s do, but the wrapper holds no ``PeftModel``, and the Hugging Face model's
       own folder would hold ``q_proj.base_layer.weight`` and ``lora_A.default.weight``, which
       ``from_pretrained`` drops (initialising ``q_proj`` at random). So ``save_pretrained`` (and the
       Trainer's ``save_model`` and checkpoints through it) writes what ``PeftModel.save_pretrained``
       writes: ``adapter_config.json`` and ``adapter_model.safetensors``, from PEFT's own
       ``get_peft_model_state_dict`` under the ``PeftModel``'s names (``base_model.model.`` + the
       model's), which ``PeftModel.from_pretrained(base, folder)`` loads. Not the model card
       (``README.md``): it reloads nothing. Several adapters (or adapter layers without PEFT's
       configs) are refused rather than written in part: the ``PeftModel`` writes them all.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .transformers_families import _LAYOUTS

__all__ = ["add_module", "injected_adapters", "peft_config", "refuse_bypassed_hooks", "register_parameter",
           "save_injected_adapter", "set_attribute"]

_NO_PEFT_AROUND = (
    "PEFT cannot wrap an OffloadedCausalLM: the adapters it saves would be named by the offloaded stages "
    "(offloaded.1.layer...) and would not load into the Hugging Face model. Add the adapters first and "
    "wrap the PeftModel: OffloadedCausalLM(peft.get_peft_model(hf_model, LoraConfig(...)), device=...), "
    "and give the TRL trainer ({trainer}) that model without peft_config{reference}")

_NOT_ON_THE_WRAPPER = (
    "an OffloadedCausalLM runs its offloaded stages, cut from the Hugging Face model when it was wrapped, and "
    "nothing else: {what} would show in parameters() and state_dict() but never run in forward. Change the "
    "Hugging Face model instead, which the stages follow: model.hf_model.lm_head = ... (or "
    "model.set_output_embeddings(...)) for the head, model.hf_model.model.layers[k].mlp = ... inside a layer; "
    "or build the model you want (a value head included) before wrapping it. Note: [Around the stages], rule 1")

#: The hook dictionaries of an ``nn.Module`` that its ``__call__`` runs (the ``with_kwargs`` and
#: ``always_call`` sets only mark entries of these).
_HOOK_KINDS = {"_forward_pre_hooks": "forward pre-hook", "_forward_hooks": "forward hook",
               "_backward_pre_hooks": "backward pre-hook", "_backward_hooks": "backward hook"}


# -- rule 1: modules and parameters set on the wrapper ---------------------------------------------

def set_attribute(model: nn.Module, name: str, value: Any) -> None:
    """``OffloadedCausalLM.__setattr__``: rule 1 of Note: [Around the stages].

    Raises:
        RuntimeError: a module or parameter set on the wrapper after wrapping, or one it holds replaced.
    """
    if _wrapped(model) and _changes_a_registration(model, name, value):
        raise RuntimeError(_NOT_ON_THE_WRAPPER.format(what=f"setting {name!r} on it"))
    nn.Module.__setattr__(model, name, value)


def add_module(model: nn.Module, name: str, module: nn.Module | None) -> None:
    """``OffloadedCausalLM.add_module`` (``register_module`` too): as :func:`set_attribute`."""
    if _wrapped(model) and model._modules.get(name, ...) is not module:
        raise RuntimeError(_NOT_ON_THE_WRAPPER.format(what=f"adding module {name!r} to it"))
    nn.Module.add_module(model, name, module)


def register_parameter(model: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """``OffloadedCausalLM.register_parameter``: as :func:`set_attribute`."""
    if _wrapped(model) and model._parameters.get(name, ...) is not param:
        raise RuntimeError(_NOT_ON_THE_WRAPPER.format(what=f"registering parameter {name!r} on it"))
    nn.Module.register_parameter(model, name, param)


def _wrapped(model: nn.Module) -> bool:
    # The wrapper's own construction sets "offloaded" first and the stages last.
    return "stages" in model.__dict__


def _changes_a_registration(model: nn.Module, name: str, value: Any) -> bool:
    registered = {**model._parameters, **model._modules}
    if name in registered:
        return value is not registered[name]
    return isinstance(value, (nn.Module, nn.Parameter))


# -- rule 2: hooks the stages bypass ---------------------------------------------------------------

def refuse_bypassed_hooks(model: Any) -> None:
    """Rule 2 of Note: [Around the stages], at every forward of ``model`` (an ``OffloadedCausalLM``).
    Cheap: four dictionaries of three or four modules.

    Raises:
        RuntimeError: a hook on the Hugging Face model, its decoder, or the ``PeftModel`` around them.
    """
    for where, container in _bypassed_containers(model):
        for kind, hooks in ((kind, getattr(container, attribute)) for attribute, kind in _HOOK_KINDS.items()):
            if hooks:
                hook = next(iter(hooks.values()))
                raise RuntimeError(
                    f"a {kind} ({getattr(hook, '__qualname__', repr(hook))}) is registered on {where}, which the "
                    "OffloadedCausalLM's forward never calls: its offloaded stages call the model's layers one by "
                    "one, so the hook would silently not run (Note: [Around the stages], rule 2). Remove it "
                    "(handle.remove()) and register it on the OffloadedCausalLM itself (it sees the forward's "
                    "arguments and its CausalLMOutputWithPast), or on a module the stages call: a decoder layer "
                    "(its output is the hidden states after it), the final norm, lm_head or the input embeddings")


def _bypassed_containers(model: Any) -> Iterator[tuple[str, nn.Module]]:
    hf_model = model.hf_model
    if model.peft_model is not None:
        yield "the PeftModel it wraps", model.peft_model
        tuner = getattr(model.peft_model, "base_model", None)
        if isinstance(tuner, nn.Module) and tuner is not hf_model:
            yield f"the PeftModel's {type(tuner).__name__} (peft_model.base_model)", tuner
    yield f"the Hugging Face model (model.hf_model, a {type(hf_model).__name__})", hf_model
    model_type = hf_model.config.model_type
    base = "transformer" if model_type == "gpt2" else _LAYOUTS[model_type].base
    yield f"its decoder (model.hf_model.{base})", getattr(hf_model, base)


# -- rule 3: PEFT around the wrapper ---------------------------------------------------------------

def _peft_config(model: Any) -> Any:
    if model.peft_model is None:
        raise AttributeError("peft_config")
    return model.peft_model.peft_config


def _refuse_peft_around(model: Any, value: Any) -> None:
    # PEFT's tuners set it on the model they wrap: get_peft_model(OffloadedCausalLM(...)), or TRL's
    # SFTTrainer(peft_config=...). Their adapters would be named by the stages, not by the model.
    trainer = _trl_trainer_calling()
    # DPO and KTO then need the reference precomputed (rule 2 of Note: [What the trainers cannot get
    # from the model] in transformers_refusals.py): the next refusal, said at once.
    reference = (f", and {trainer.removesuffix('Trainer')}Config(precompute_ref_log_probs=True)"
                 if trainer in ("DPOTrainer", "KTOTrainer") else "")
    raise ValueError(_NO_PEFT_AROUND.format(trainer=trainer or "SFTTrainer, DPOTrainer, ...", reference=reference))


def _trl_trainer_calling() -> str | None:
    """The class name of the TRL trainer whose ``__init__`` is on the stack (adding the adapters), if any:
    PEFT, which sets ``peft_config``, is not told which trainer called it, so the stack is read."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and "self" in frame.f_locals:
            # By TRL's own class: a user's subclass is named by the trainer it subclasses.
            mro = type(frame.f_locals["self"]).__mro__
            trl_class = next((c for c in mro if c.__module__.startswith("trl.")), None)
            if trl_class is not None:
                return trl_class.__name__
        frame = frame.f_back
    return None


#: ``OffloadedCausalLM.peft_config``: the wrapped ``PeftModel``'s adapter configs; setting it is
#: refused (rule 3 of Note: [Around the stages]).
peft_config = property(_peft_config, _refuse_peft_around)


# -- rule 4: adapters injected after wrapping ------------------------------------------------------

def holds_adapters(hf_model: nn.Module) -> bool:
    """Whether ``hf_model`` holds a PEFT layer (an adapter, or ``modules_to_save``' wrapper): none
    once ``merge_and_unload()`` or ``unload()`` took them out. Reads every module: for saving."""
    if sys.modules.get("peft") is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return any(isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)) for module in hf_model.modules())


def injected_adapters(hf_model: nn.Module) -> Mapping[str, Any] | None:
    """The configs of the PEFT adapters injected into ``hf_model`` (adapter name -> config), or ``None``
    when it holds no PEFT layer (rule 4 of Note: [Around the stages]). Reads every module: for saving.

    Raises:
        ValueError: PEFT layers without PEFT's configs beside them, which no ``PeftModel`` could save.
    """
    if not holds_adapters(hf_model):
        return None  # merged and unloaded, say: the model's own folder holds it
    configs = hf_model.__dict__.get("peft_config")  # PEFT's tuners set it on the model they inject into
    if not isinstance(configs, Mapping) or not configs:
        raise ValueError(
            "this OffloadedCausalLM's Hugging Face model holds PEFT adapter layers but no peft_config: "
            "save_pretrained cannot write an adapter folder that PeftModel.from_pretrained loads, nor a model "
            "folder that from_pretrained loads. Add adapters with peft.get_peft_model(model.hf_model, config)")
    return configs


def save_injected_adapter(hf_model: nn.Module, configs: Mapping[str, Any], save_directory: str | os.PathLike[str],
                          args: tuple[Any, ...], state_dict: Mapping[str, torch.Tensor] | None,
                          kwargs: dict[str, Any]) -> None:
    """Write what ``PeftModel.save_pretrained`` writes for the one adapter in ``configs`` (rule 4 of
    Note: [Around the stages]): its weights from ``state_dict`` when given (in the Hugging Face
    model's names), else from the model; ``save_embedding_layers`` as there.

    Raises:
        ValueError: several adapters.
        TypeError: another argument (``max_shard_size``, ...): an adapter is written whole.
    """
    from peft.utils import SAFETENSORS_WEIGHTS_NAME
    from peft.utils.save_and_load import get_peft_model_state_dict
    from safetensors.torch import save_file

    if len(configs) != 1:
        raise ValueError(
            f"this OffloadedCausalLM's Hugging Face model holds {len(configs)} PEFT adapters ({', '.join(configs)}), "
            "injected after wrapping; save_pretrained writes one adapter as PeftModel.save_pretrained does, and "
            "would leave the others out. Save them with the PeftModel that peft.get_peft_model returned, after "
            "optimizer.synchronize(): peft_model.save_pretrained(directory), or delete_adapter the others")
    embedding_layers = kwargs.pop("save_embedding_layers", "auto")
    if args or kwargs:
        raise TypeError(
            f"save_pretrained writes this model's PEFT adapter whole, as PeftModel.save_pretrained does; it takes "
            f"save_embedding_layers and state_dict, not {', '.join([*map(repr, args), *kwargs])}")
    [(name, config)] = configs.items()
    tensors = get_peft_model_state_dict(hf_model, state_dict=state_dict, adapter_name=name,
                                        save_embedding_layers=embedding_layers)
    # The PeftModel's names: its tuner (base_model) holds the Hugging Face model (model). Copied: the
    # host copies of a slice are views of one buffer, which safetensors would refuse as shared.
    tensors = {f"base_model.model.{key}": tensor.detach().clone(memory_format=torch.contiguous_format)
               for key, tensor in tensors.items()}
    directory = os.path.join(save_directory, name) if name != "default" else os.fspath(save_directory)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    config = copy.deepcopy(config)
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    if config.base_model_name_or_path is None:
        config.base_model_name_or_path = hf_model.__dict__.get("name_or_path") or None
    auto_mapping = None if config.task_type is not None else {
        "base_model_class": type(hf_model).__name__, "parent_library": type(hf_model).__module__}
    config.save_pretrained(directory, auto_mapping_dict=auto_mapping)
