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
       zero, and training, ``update_and_allocate`` included, is the ``PeftModel``'s bit for bit:
       rule 7), and SHADOW (hooks on the model's forward run a shadow network beside the decoder
       layers). So are methods whose layers share tensors across slices: VeRA, PVeRA and RandLoRA
       register one pair of frozen random projections in every adapted layer, and a buffer lives in
       one slice; trainable tokens (``trainable_token_indices``) on a tied embedding, whose wrappers
       of the embedding and of ``lm_head`` share one buffer of token indices (untying afterwards
       keeps it shared); and a LoRA on a tied embedding with ``ensure_weight_tying=True``, whose
       ``lm_head`` LoRA matrices are the embedding's (PEFT records the tied targets in the config's
       ``target_modules_to_tie``). Every adapter the model holds is checked, active or not:
       ``set_adapter`` registers nothing new, so an adapter switched on later would run unseen
       (:func:`refuse_peft_methods`).
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
       Two injections change nothing inside the slices, so no layout follows and the stages would
       silently run the bare layers; they are refused where PEFT makes them (rule 8).
    6. ``OffloadedCausalLM(peft_model).state_dict()`` holds the Hugging Face model's names
       (``model.layers.0...``), which ``peft_model.get_base_model()`` loads; the ``PeftModel`` names
       the same tensors ``base_model.model.model.layers.0...``. Its ``load_state_dict`` takes
       those names too (:func:`peft_names_as_hf`), so a checkpoint of the plain ``PeftModel``
       loads into it; a ``PeftModel`` does not take the Hugging Face names.
    7. AdaLoRA's loop is ``optimizer.step(); peft_model.base_model.update_and_allocate(i)``, and
       ``update_and_allocate`` reads every adapter and its gradient (the importance scores) and
       masks ``lora_E`` in place, through the tuner, not through the ``OffloadModel``. Under
       ``OffloadOptimizer`` the updates ``step()`` handed to the worker may still be running
       then: it read some adapters before their update and masked others under it (adapters
       0.07 apart after 8 steps, on some runs). So once an AdaLoRA adapter is seen (at the cut or
       before a layout), ``AdaLoraModel.update_and_allocate`` first waits for the pending updates
       of every model that holds its parameters, as a read through that model waits
       (``SettledModule`` in ``offload/modeling/settled.py``: the shadows are cast again, since it
       writes the masters): :func:`wait_for_updates_of`. PEFT's class is patched, once: the
       tuner a ``get_peft_model`` after wrapping builds is out of reach, and a method set on an
       instance would be copied by a deep copy bound to the original. For a model no
       ``OffloadModel`` holds it waits for nothing.
    8. Injected after wrapping (rule 5), two methods change nothing the slices register, so no
       layout follows and :class:`PeftRefusals` never runs: a prompt-learning ``PeftModel``
       (virtual tokens or a key/value cache before the model: its ``base_model`` is the Hugging
       Face model itself, which keeps running bare in the stages) and
       ``LoraConfig(layer_replication=...)``, which sets a new list of copied layers on the
       decoder (the stages keep the old layers, without adapters). PyTorch's global
       module-registration hook sees both where they happen (the ``PeftModel`` registering the
       model as its ``base_model``; the decoder's ``ModuleList`` of layers set anew) and refuses
       them there, before the registration, so ``get_peft_model`` raises and leaves the model as
       it was (:class:`_CutModels`). Only while the stages cut from the model live: running the
       ``PeftModel`` on its own after dropping the wrapper is the plain ``PeftModel``'s business.
       The hook, and ``_Replacements``' of rule 5, leave with the last stages (``WatchedHooks`` in
       ``offload/streams/watched_hooks.py``): compiled autograd cannot trace a global registration
       hook, of any model.
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from ..streams.watched_hooks import WatchedHooks
from ..walk.engine import live_engines


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
    ``check_layout``, which the engine calls before it lays the slices out again. An AdaLoRA
    adapter found at the cut or there makes ``update_and_allocate`` wait for pending updates (rule
    7). While it lives, what no layout would show is refused where it happens (rule 8,
    :class:`_CutModels`).

    Holds the Hugging Face model, so that a copy or a pickle of the stages checks its own copy of it.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        self.hf_model = hf_model
        _CutModels.add(self)
        self._settle_adalora()

    def __call__(self) -> None:
        refuse_peft_methods(self.hf_model)
        self._settle_adalora()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _CutModels.add(self)  # a copy's stages hold the copy's model
        self._settle_adalora()  # unpickled in another process, whose PEFT is unpatched

    def _settle_adalora(self) -> None:
        configs = self.hf_model.__dict__.get("peft_config")  # as refuse_peft_methods reads them
        if isinstance(configs, Mapping) and any(_kind(config) == "ADALORA" for config in configs.values()):
            _settle_before_update_and_allocate()


def wait_for_updates_of(module: nn.Module) -> None:
    """Block until the pending host updates of every ``OffloadModel`` that holds a parameter of
    ``module`` are done, as a read of its parameters through that model waits
    (``SettledModule._settle``): the caller may write them next, so the shadows the updates wrote are
    cast again. Nothing pending (or no such model): a check per live model."""
    ids: set[int] | None = None
    for engine in live_engines():
        if not engine.updates.pending():
            continue
        if ids is None:
            ids = {id(p) for p in module.parameters()}
        if not engine.parameter_ids.isdisjoint(ids):
            engine.updates.wait_all(shadows_stale=True)


def _settle_before_update_and_allocate() -> None:
    """Make ``AdaLoraModel.update_and_allocate`` wait for the pending updates of the models holding
    the tuner's parameters first (Note: [PEFT models], rule 7). Once: later calls find it patched."""
    from peft.tuners.adalora import AdaLoraModel

    original = AdaLoraModel.update_and_allocate
    if getattr(original, "waits_for_offloaded_updates", False):
        return

    @functools.wraps(original)
    def update_and_allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        wait_for_updates_of(self.model)
        return original(self, *args, **kwargs)

    update_and_allocate.waits_for_offloaded_updates = True  # type: ignore[attr-defined]
    AdaLoraModel.update_and_allocate = update_and_allocate


class _CutModels:
    """The Hugging Face models that live stages were cut from, and their decoders' lists of layers,
    so that a registration the stages cannot follow is refused where it is made (Note: [PEFT
    models], rule 8): a ``PeftModel`` taking the model as its ``base_model`` (prompt learning), and
    the list of layers set anew (``layer_replication``).

    PyTorch's global module-registration hook, installed while a :class:`PeftRefusals` lives (a
    ``WatchedHooks``), sees every registration; each table is keyed weakly by the module and holds the :class:`PeftRefusals` of the stages weakly, so a model whose stages are
    gone is refused nothing. The cost for any other registration: a lookup in each table.
    """

    #: Hugging Face model -> the PeftRefusals of the stages cut from it
    models: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[PeftRefusals]] = weakref.WeakKeyDictionary()
    #: the decoder's ModuleList of layers (``model.layers``, GPT-2's ``transformer.h``) -> the same
    layer_lists: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[PeftRefusals]] = weakref.WeakKeyDictionary()
    hook = WatchedHooks(nn.modules.module.register_module_module_registration_hook)

    @classmethod
    def add(cls, refusals: PeftRefusals) -> None:
        cls.hook.watch(refusals, cls._registered)
        model = refusals.hf_model
        cls.models.setdefault(model, weakref.WeakSet()).add(refusals)
        # The decoder is a child of the model, and its layers the one ModuleList among the decoder's
        # children in every supported family (the experts' lists sit inside the layers).
        for parent in (model, *model.children()):
            for child in parent.children():
                if isinstance(child, nn.ModuleList):
                    cls.layer_lists.setdefault(child, weakref.WeakSet()).add(refusals)

    @classmethod
    def _registered(cls, module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        if submodule is None or not (cls.models or cls.layer_lists):
            return
        replaced = module.__dict__.get("_modules", {}).get(name)
        if replaced is not None and replaced is not submodule and _held(cls.layer_lists, replaced):
            raise ValueError(_replaced_layers_message(module, name))
        peft = sys.modules.get("peft")
        if peft is not None and isinstance(module, peft.PeftModel) and _held(cls.models, submodule):
            raise ValueError(_prompt_learning_message(module))


def _held(table: weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[PeftRefusals]], module: nn.Module) -> bool:
    """Whether live stages were cut from ``module`` (a table of :class:`_CutModels`)."""
    holders = table.get(module)
    if not holders:
        return False
    gc.collect()  # about to refuse: stages dropped but kept in a reference cycle do not count
    return bool(holders)


def _replaced_layers_message(decoder: nn.Module, name: str) -> str:
    return (
        f"{type(decoder).__name__}.{name}, the decoder's list of layers, is being replaced after the model was cut "
        "into stages (causal_lm_sequential, OffloadedCausalLM, load_causal_lm); PEFT's "
        "LoraConfig(layer_replication=...) does this. The stages hold the layers cut before and would keep running "
        "them, without the new layers or their adapters. Call peft.get_peft_model(hf_model, config) before "
        "wrapping, and wrap the PeftModel it returns; a model loaded slice by slice (load_causal_lm, "
        "offload-finetune --model) gets its adapters after wrapping, so load it with transformers' from_pretrained "
        "for layer_replication")


def _prompt_learning_message(peft_model: nn.Module) -> str:
    kind = getattr(peft_model.__dict__.get("peft_type"), "value", "prompt learning")
    return (
        f"a PeftModel with a prompt-learning adapter ({kind}) around a Hugging Face model that was cut into stages "
        "(causal_lm_sequential, OffloadedCausalLM, load_causal_lm): its forward adds virtual tokens or a key/value "
        "cache before the model runs, which the stages never see, so the offloaded model would train and evaluate "
        "the bare model. Prompt learning is refused at the cut too. Adapter methods that live inside the model's "
        "layers (LoRA, DoRA, IA3, LoHa, LoKr, ...) can be added after wrapping; to run this PeftModel without "
        "offloading, drop the wrapper first")


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
    kind = _kind(config)
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
    if getattr(config, "target_modules_to_tie", None):
        tied = ", ".join(sorted(config.target_modules_to_tie))
        return (f"a LoRA on a tied embedding with ensure_weight_tying=True: PEFT gives {tied} the embedding's LoRA "
                "matrices (the same memory), and the stages hold the embedding in the first slice and lm_head in "
                "the last, each slice with tensors of its own. Pass ensure_weight_tying=False (a targeted lm_head "
                "gets LoRA matrices of its own; untargeted, it keeps the embedding's frozen weight), or train the "
                "whole embedding (modules_to_save=['embed_tokens'], where ensure_weight_tying=True is supported)")
    if kind in _SHARED_PROJECTIONS:
        return (f"a {_SHARED_PROJECTIONS[kind]} adapter: every adapted layer holds the same frozen random "
                "projections (one buffer shared by all of them), and the stages cut the layers into slices that "
                "each hold their own tensors. Use LoRA (LoraConfig) or another method whose adapters are each "
                "layer's own (DoRA, IA3, LoHa, LoKr, OFT)")
    return None


def _kind(config: Any) -> str:
    """The method's name as PEFT spells it (``"LORA"``, ``"ADALORA"``)."""
    return str(getattr(config.peft_type, "value", config.peft_type))


def _refuse(configs: Mapping[str, Any]) -> None:
    """Raise for the first of ``configs`` (adapter name -> config) whose method the stages cannot run."""
    for name, config in configs.items():
        refusal = _refusal(config)
        if refusal is not None:
            raise ValueError(f"causal_lm_sequential cannot cut a PeftModel with {refusal}. This holds for the adapter "
                             f"{name!r} active or not (set_adapter would switch it on unseen); "
                             f"delete_adapter({name!r}) removes it")
