"""What the Hugging Face trainers can ask of an :class:`~offload.integrations.causal_lm.OffloadedCausalLM`
that it cannot give, refused with what to do instead, where the model would otherwise train or
evaluate differently from the plain model, or fail somewhere deep inside.

This file holds the checks, and the placeholder for missing logits; ``causal_lm.py`` calls them:
``offload_optimizer`` the checks of the trainer's arguments (:func:`refuse_trainer_arguments`, before
any step), the forward and ``base_model`` those of what arrives there. It imports neither
transformers nor TRL nor PEFT.

Note: [What the trainers cannot get from the model]
    1. An adapter on ``lm_head`` under a head that projects through its weight. TRL's fused LM
       head (``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``) calls ``model.base_model`` for the
       hidden states and multiplies them by ``model.get_output_embeddings().weight`` itself: for a
       PEFT layer (LoRA, IA3, ...) that is the frozen base weight, so the adapter would get no
       gradient and never train. TRL refuses this for a ``PeftModel``, by ``isinstance``, which an
       OffloadedCausalLM is not; ``base_model`` refuses it here, for any caller. The model's own
       forward runs the adapted ``lm_head`` module (``Head.logits``) and trains it.
    2. The reference of ``DPOTrainer`` and ``KTOTrainer``. For a ``PeftModel`` without
       ``ref_model`` they take the reference from the model itself (a frozen copy of its adapters,
       or the adapters disabled); they decide so by ``isinstance`` too, so for an OffloadedCausalLM
       they load the base model a second time from ``config._name_or_path``, whole and not
       offloaded, without the adapters (or fail with an ``OSError`` for a model never saved).
       ``offload_optimizer`` refuses their arguments unless ``precompute_ref_log_probs=True``: the
       reference log-probabilities are then computed once before the first step by the model
       itself, its adapters as they are then, which is the ``PeftModel``'s reference, bit for bit
       (``tests/test_trl.py``), or by the ``ref_model`` passed. The trainer's own optimizer goes
       unchecked: the model never sees the trainer.
    3. A mixture of experts' load-balancing loss where the stages cannot carry the router logits.
       The model adds ``router_aux_loss_coef`` times a loss computed from every layer's router
       logits when ``output_router_logits`` is asked for; the stages carry them to the head for
       the families whose ``load_balancing_loss_func`` computes it (Note: [Router logits] in
       ``transformers_router.py``), and the loss is the model's. For another family with router
       logits (Llama 4, whose model returns them without a loss) TRL's trainers would still ask
       for them unless ``router_aux_loss_coef=0.0`` (their default, ``None``, takes the model
       config's coefficient): ``offload_optimizer`` refuses their arguments, and the forward (and
       ``base_model``) refuse ``output_router_logits=True`` from the config or the call, naming
       the setting that turns it off.
    4. Logits from a loss computed in the head (``loss_chunk_tokens``). ``Trainer.prediction_step``
       gathers every field of the output but the loss as the predictions: with no ``logits`` field
       ``compute_metrics`` would get an empty tuple. The output's ``logits`` is
       :class:`MissingLogits` instead, which raises at its first use (the Trainer's ``detach()``
       before the metrics), while an evaluation of the loss alone (``prediction_loss_only``, or no
       ``compute_metrics``) gathers it but never uses it.
    5. Packed sequences kept apart in convolution and linear-attention layers (LFM2's ``"conv"``,
       Qwen3-Next's ``"linear_attention"``). The padding-free collators (TRL's ``SFTTrainer`` with
       ``packing=True``, ``DataCollatorWithFlattening(return_flash_attn_kwargs=True,
       return_seq_idx=True)``) add the sequences' boundaries to the batch as ``seq_idx``,
       ``cu_seq_lens_q/k`` and ``max_length_q/k``. Attention layers find the same boundaries in
       ``position_ids`` (the mask functions look for them there), so an attention-only model drops
       the keywords and computes the model's result bit for bit. The other layers find them only in
       the keywords, which the model passes to their kernels: with the ``causal_conv1d`` (and
       ``fla``) packages they keep the sequences apart, without them the model refuses the batch.
       The stages carry only the hidden states, the 2-D mask and the positions from slice to slice,
       and would run the convolution across the boundaries, each document's last tokens leaking into
       the next one's first. The forward (and ``base_model``) refuse a batch carrying a keyword such
       a layer reads (``transformers_stages.packed_sequence_keywords``: ``seq_idx`` for LFM2, also
       ``cu_seq_lens_q`` for Qwen3-Next); the others are dropped, as for attention. A batch packed with
       ``position_ids`` alone (``DataCollatorWithFlattening()``'s default) is not refused: the model
       itself then runs these layers across the boundaries, silently, and the stages compute what it
       computes, bit for bit.
    6. Every layer's hidden states or attention weights. The offloaded slices pass on only the
       hidden states at their boundaries, and no attention weights. A keyword asking for them is
       refused with the forward's other keywords. ``output_hidden_states=True`` or
       ``output_attentions=True`` in the model's config, which the model honours in every forward
       where the call does not say otherwise, is warned of instead (once): a saved config may carry
       it into a training run that never reads them, where the loss and the logits are the model's;
       the outputs hold ``None`` in their place. ``False`` (what a trainer or a generation config
       may set) is silent.
    7. Completions generated from the model as it trains. TRL's on-policy trainers (``GRPOTrainer``,
       ``RLOOTrainer``, ``DistillationTrainer``, the experimental online DPO and GKD) call
       ``generate`` on the model at every step, which this model refuses (its forward keeps no
       cache, and generating through the stages is not built): they accepted the model and failed
       at the first step. ``offload_optimizer`` refuses their arguments, known by their class
       (a subclass's too, GMPO's of GRPO's): those that generate at every step, those that mix
       generated and given completions when their share ``lmbda`` is above 0 (GKD, GOLD,
       IW-OPD: at 0 they never generate), and those that generate while evaluating when told
       (``generate_during_eval``: CPO, ORPO). Not by the settings a class has: GKD's config has
       ``max_new_tokens`` at ``lmbda=0`` too, A2PO's has neither and generates. The trainer's own
       optimizer goes unchecked, as in rule 2, and fails at that first step.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["MissingLogits", "attribute_or_advice", "refuse_adapter_on_head", "refuse_generating_trainer",
           "refuse_packed_sequences", "refuse_reference_from_path",
           "refuse_router_logits", "refuse_router_loss", "refuse_trainer_arguments", "refuse_update_in_backward",
           "warn_of_cache", "warn_of_layer_outputs"]

_NO_LOGITS = (
    "this OffloadedCausalLM computes the loss in its head (loss_chunk_tokens) and returns no logits, which "
    "compute_metrics, preprocess_logits_for_metrics and Trainer.predict() need. Evaluate the loss alone "
    "(TrainingArguments(prediction_loss_only=True), or no compute_metrics), or evaluate and predict with a model "
    "built without loss_chunk_tokens (after training, from the folder trainer.save_model wrote)")


class MissingLogits(torch.Tensor):
    """The ``logits`` of an output whose loss the head computed: there are none, and any use says so
    (rule 4 of Note: [What the trainers cannot get from the model]).

    A tensor (empty), because the walks over an output that the Trainer and Accelerate make pass
    tensors along and reject anything else with a message of their own (``pad_across_processes``);
    every torch operation on it raises a ``TypeError`` that says what to do, the Trainer's
    ``detach()`` before the metrics first. Reading its ``dtype`` is allowed: Accelerate's float32
    conversion of a mixed-precision model's outputs reads every tensor's, on the loss-only path too.
    """

    @staticmethod
    def __new__(cls) -> MissingLogits:
        return torch.Tensor._make_subclass(cls, torch.empty(0))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READABLE:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise TypeError(_NO_LOGITS)

    def __repr__(self) -> str:  # type: ignore[override]
        return "MissingLogits()"


#: The arguments of TRL's trainers that generate from the model at every step (TRL 1.16, the
#: experimental ones included), by class name: rule 7 of the note.
_GENERATING = frozenset({"GRPOConfig", "RLOOConfig", "OnlineDPOConfig", "DistillationConfig", "A2POConfig",
                         "SDPOConfig", "SDFTConfig"})
#: Those that generate for a share ``lmbda`` of the batches (on-policy), given completions otherwise.
_MIXING = frozenset({"GKDConfig", "GOLDConfig", "IWOPDConfig"})

#: What may be read of :class:`MissingLogits` (see there).
_READABLE = {torch.Tensor.dtype.__get__}


def refuse_trainer_arguments(model: Any, args: Any) -> None:
    """Raise for the Trainer's arguments this model cannot train under, before any step rather than
    at the first step or after the last (Note: [What the trainers read from the model]). ``model``
    is an ``OffloadedCausalLM``."""
    if getattr(args, "label_smoothing_factor", 0) and model.stages.loss_chunk_tokens is not None:
        raise ValueError(
            "label_smoothing_factor needs the logits, and this OffloadedCausalLM computes the loss in its head "
            "(loss_chunk_tokens) without them: build the model without loss_chunk_tokens, or train with "
            "label_smoothing_factor=0")
    if getattr(args, "load_best_model_at_end", False) and model.peft_model is not None:
        raise ValueError(
            "load_best_model_at_end cannot load the best adapters into an OffloadedCausalLM: the Trainer reloads "
            "adapters only into a PeftModel it trains directly, and would look for the whole model's weights in the "
            "checkpoint. Set load_best_model_at_end=False (metric_for_best_model alone still records "
            "trainer.state.best_model_checkpoint) and load the best adapters afterwards: "
            "peft.PeftModel.from_pretrained(base_model, trainer.state.best_model_checkpoint)")
    # Note: [What the trainers cannot get from the model], rules 2, 3 and 7.
    refuse_generating_trainer(args)
    refuse_reference_from_path(args, model.peft_model is not None)
    if not model.stages[0].router_logits:  # Note: [Router logits]
        refuse_router_loss(model.config, args)


def refuse_update_in_backward(options: dict[str, Any]) -> None:
    """Raise for ``update_in_backward``: between backward and ``step()`` the Trainer rewrites every
    gradient in place (it clips them, or, to log their norm, clips them at an infinite norm: a
    multiplication by one that OffloadOptimizer's check cannot tell from a real change)."""
    if options.get("update_in_backward"):
        raise ValueError(
            "update_in_backward cannot be used under transformers.Trainer: between backward and optimizer.step() "
            "the Trainer rewrites every gradient in place (clip_grad_norm_; transformers 5.24 does so at an infinite "
            "norm when max_grad_norm=0, to log the norm), after the update has read them. Leave update_in_backward "
            "out here; use it in a loop of your own or with Accelerate or Lightning, without clipping")


def refuse_adapter_on_head(output_embeddings: nn.Module) -> None:
    """Raise when ``output_embeddings`` is a PEFT adapter layer, whose weight is the frozen base
    weight: a caller of ``base_model`` projects through that weight and the adapter never trains
    (rule 1 of Note: [What the trainers cannot get from the model])."""
    tuners = getattr(getattr(sys.modules.get("peft"), "tuners", None), "tuners_utils", None)
    layer_class = getattr(tuners, "BaseTunerLayer", None)
    if layer_class is not None and isinstance(output_embeddings, layer_class):
        raise ValueError(
            f"lm_head is a PEFT adapter layer ({type(output_embeddings).__name__}), and the caller of base_model "
            "(TRL's fused LM head: SFTTrainer, DPOTrainer, KTOTrainer) projects the hidden states through "
            "get_output_embeddings().weight, its frozen base weight: the adapter would never be trained (TRL refuses "
            "the same for a PeftModel). Remove 'lm_head' from target_modules (modules_to_save=['lm_head'] trains a "
            "copy of the whole head, which that projection reads), or train with transformers.Trainer, whose forward "
            "runs the adapted lm_head")


def refuse_generating_trainer(args: Any) -> None:
    """Raise for the arguments of a TRL trainer that generates from the model as it trains (rule 7 of
    Note: [What the trainers cannot get from the model])."""
    names = {cls.__name__ for cls in type(args).__mro__}
    trainer = type(args).__name__.removesuffix("Config") + "Trainer"
    if names & _GENERATING:
        when = "at every step (on-policy)"
    elif names & _MIXING and (getattr(args, "lmbda", 0) or 0) > 0:
        when = f"for a share lmbda={args.lmbda} of the steps (on-policy; lmbda=0 generates none)"
    elif getattr(args, "generate_during_eval", False):
        when = "in each evaluation (generate_during_eval=True; leave it False)"
    else:
        return
    raise ValueError(
        f"TRL's {trainer} generates completions from the model {when}, and an OffloadedCausalLM does not generate: "
        "its forward runs the offloaded stages without a cache, and model.generate() is refused. Train it with a "
        "trainer that does not generate (SFTTrainer, DPOTrainer, KTOTrainer, transformers.Trainer), or train the "
        "plain model with this one")


def refuse_reference_from_path(args: Any, is_peft: bool) -> None:
    """Raise for DPO- and KTO-like arguments (those with ``precompute_ref_log_probs``) without it, for
    a model holding PEFT adapters (rule 2 of Note: [What the trainers cannot get from the model])."""
    if not is_peft or not hasattr(args, "precompute_ref_log_probs") or args.precompute_ref_log_probs:
        return
    trainer = type(args).__name__.removesuffix("Config") + "Trainer"
    raise ValueError(
        f"TRL's {trainer} does not see the PeftModel inside an OffloadedCausalLM: given no ref_model it would load "
        "the base model a second time from config._name_or_path, whole and not offloaded, and take it without the "
        "adapters for the reference (or fail to load it, for a model never saved), where for the PeftModel it takes "
        "the model with its adapters as they are before the first step. offload_optimizer cannot see a ref_model "
        f"passed to the trainer, so it refuses either way. Pass {type(args).__name__}(precompute_ref_log_probs=True): "
        "the reference log-probabilities are then computed once before training, by this model with its adapters "
        f"(the PeftModel's reference) or by the ref_model you pass. Or, passing a ref_model, build the {trainer} "
        "without this optimizer (optimizers left at their default): the trainer's own optimizer trains it as it "
        "trains the PeftModel with that ref_model")


def refuse_router_loss(config: Any, args: Any) -> None:
    """Raise where the trainer's arguments or the model's config ask for a mixture of experts' load-balancing
    loss (rule 3 of Note: [What the trainers cannot get from the model]). TRL's rule: a model whose
    config has ``output_router_logits`` gets the loss unless the coefficient, the argument's or else
    the config's, is zero."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hasattr(text_config, "output_router_logits"):
        return
    given = getattr(args, "router_aux_loss_coef", None)
    coefficient = getattr(text_config, "router_aux_loss_coef", 0.0) if given is None else given
    if text_config.output_router_logits:
        asked = "output_router_logits=True in the model's config"
    elif hasattr(args, "router_aux_loss_coef") and coefficient != 0:
        asked = f"{type(args).__name__}(router_aux_loss_coef={given!r}) weights it by {coefficient}"
    else:
        return
    raise ValueError(_router_message(asked))


def refuse_router_logits(config: Any, kwargs: Mapping[str, Any]) -> None:
    """Raise for ``output_router_logits=True`` in a forward's arguments, or else in the model's config
    (rule 3 of Note: [What the trainers cannot get from the model]): the call's decides, as in the model.
    A model without routers (its config has no ``output_router_logits``: a dense Llama) takes the
    keyword and ignores it, and so does its OffloadedCausalLM."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hasattr(text_config, "output_router_logits"):
        return
    given = kwargs.get("output_router_logits")
    if given or (given is None and getattr(text_config, "output_router_logits", False)):
        where = "the call" if given else "the model's config"
        raise TypeError(_router_message(f"output_router_logits=True in {where}"))


def refuse_packed_sequences(readers: Mapping[str, str], model_type: str, kwargs: Mapping[str, Any]) -> None:
    """Raise for a packed batch whose sequence boundaries a layer would need from the forward's
    keywords (rule 5 of Note: [What the trainers cannot get from the model]). ``readers`` maps each
    keyword such a layer of this model reads to that layer's type
    (``transformers_stages.packed_sequence_keywords``)."""
    given = [key for key in readers if kwargs.get(key) is not None]
    if not given:
        return
    kinds = ", ".join(dict.fromkeys(repr(readers[key]) for key in given))
    raise ValueError(
        f"this batch packs several sequences into a row and gives their boundaries in {', '.join(given)}, which "
        f"{model_type}'s {kinds} layers need to keep the sequences apart; an OffloadedCausalLM passes on only the "
        "hidden states, attention mask and position ids from slice to slice, so each sequence would leak into the "
        "next. Give each sequence a row of its own: with TRL, SFTConfig(packing=False) (and padding_free=False, its "
        "default); elsewhere a padding collator rather than DataCollatorWithFlattening")


#: Why a keyword of ``forward`` is refused and what to do instead, for those a caller types (a
#: dataset's columns reach ``forward`` through the Trainer, and get its advice instead).
_FORWARD_HINTS = {
    "output_hidden_states": "its slices pass on only the hidden states at their boundaries: model.base_model(...) "
                            "returns the last layer's (normed) hidden states, and a forward hook on a layer "
                            "(model.hf_model.model.layers[k]) sees that layer's",
    "output_attentions": "its slices return no attention weights: a forward hook on an attention layer "
                         "(model.hf_model.model.layers[k].self_attn) sees them, with attn_implementation='eager'",
    "inputs_embeds": "its first slice embeds input_ids itself: pass input_ids, and change the embeddings with a "
                     "forward hook on model.get_input_embeddings() (as NEFTune does)",
    "token_type_ids": "if the tokenizer added token_type_ids, call it with return_token_type_ids=False or drop "
                      "them from the batch",
    "past_key_values": "its slices keep no key-value cache: decode with the Hugging Face model it wraps "
                       "(model.hf_model.generate, after optimizer.synchronize())",
}
_FORWARD_HINTS["cache_position"] = _FORWARD_HINTS["past_key_values"]


def forward_refusal(refused: Sequence[str]) -> str:
    """The message of ``OffloadedCausalLM.forward`` for keywords it cannot honour (``refused``, set
    to something other than ``None`` or ``False``), or for a call without ``input_ids``: what it
    takes, a reason and a way on for each keyword it knows, the Trainer's advice for the rest."""
    hints = list(dict.fromkeys(_FORWARD_HINTS[key] for key in refused if key in _FORWARD_HINTS))
    unknown = [key for key in refused if key not in _FORWARD_HINTS or key == "token_type_ids"]
    what = f"it cannot honour {', '.join(refused)}" if refused else "it needs input_ids"
    columns = (". With transformers.Trainer keep remove_unused_columns=True (the default) so that other dataset "
               "columns are dropped" if unknown or not refused else "")
    return ("OffloadedCausalLM.forward takes input_ids, attention_mask, position_ids, labels (or shift_labels), "
            "num_items_in_batch, logits_to_keep and return_dict (use_cache and output_router_logits as the model "
            f"does); {what}" + "".join(f". {hint[0].upper()}{hint[1:]}" for hint in hints) + columns)


def warn_of_layer_outputs(config: Any, kwargs: Mapping[str, Any]) -> None:
    """Warn of ``output_hidden_states=True`` or ``output_attentions=True`` in the model's config
    where the call does not set it (rule 6 of Note: [What the trainers cannot get from the model]):
    the outputs hold ``None`` there. The call's own are refused with its other keywords."""
    asked = [key for key in ("output_hidden_states", "output_attentions")
             if key not in kwargs and getattr(config, key, False)]
    if asked:
        warnings.warn(
            f"the model's config asks every forward for {' and '.join(f'{key}=True' for key in asked)}, which an "
            "OffloadedCausalLM cannot return (its slices pass on only the hidden states at their boundaries): its "
            f"outputs hold None there; the loss and logits are the model's. Set "
            f"{' and '.join(f'model.config.{key} = False' for key in asked)} to say so and silence this; "
            "model.base_model(...) returns the last layer's (normed) hidden states", UserWarning, stacklevel=2)


def warn_of_cache(kwargs: Mapping[str, Any]) -> None:
    """Warn of ``use_cache=True`` in a call: the slices keep no key-value cache, so the output's
    ``past_key_values`` is ``None`` (and ``return_dict=False`` gives no cache in its tuple). Only the
    call's: the config's default (``use_cache=True`` in most models) reaches every forward unasked."""
    if kwargs.get("use_cache") is True:
        warnings.warn(
            "OffloadedCausalLM ignores use_cache=True: its slices keep no key-value cache, so past_key_values is "
            "None (and a return_dict=False tuple holds the loss and logits only). Pass use_cache=False, or leave "
            "it out, to silence this", UserWarning, stacklevel=3)


def attribute_or_advice(model: nn.Module, name: str) -> Any:
    """``nn.Module``'s attribute lookup; for ``generate``, which the model lacks (it keeps no cache),
    an ``AttributeError`` that says where to generate (``hasattr`` stays ``False``)."""
    try:
        # The next lookup after this one in the class's order (nn.Module's, in transformers 5).
        lookup = next(getattr_ for klass in type(model).__mro__
                      if (getattr_ := klass.__dict__.get("__getattr__")) not in (None, attribute_or_advice))
        return lookup(model, name)
    except AttributeError:
        if name != "generate":
            raise
        raise AttributeError(_no_generate(model)) from None


def _no_generate(model: nn.Module) -> str:
    """Where to generate instead: with the Hugging Face model, whose parameters are on the host, but
    for resident slices' (on the device, where ``hf_model.generate`` would meet both)."""
    offloaded = model.__dict__.get("_modules", {}).get("offloaded")
    resident, device = getattr(offloaded, "resident_slices", 0), getattr(offloaded, "device", "cpu")
    saved = "the folder save_pretrained() or Trainer.save_model() wrote"
    if resident and torch.device(device).type != "cpu":
        where = (f"its Hugging Face model's parameters are on the host but for its {resident} resident slice(s)' "
                 f"(on {device}), so generate with the model AutoModelForCausalLM.from_pretrained loads from {saved}")
    else:
        where = ("generate with the Hugging Face model it wraps (model.hf_model, after optimizer.synchronize(); its "
                 f"parameters are on the host), or load {saved} with AutoModelForCausalLM")
    return f"an OffloadedCausalLM has no generate(): its slices keep no key-value cache; {where}"


def _router_message(asked: str) -> str:
    return (
        f"an OffloadedCausalLM cannot add this mixture of experts' load-balancing loss ({asked}): the offloaded "
        "slices carry router logits only for the families that compute it with a load_balancing_loss_func "
        "(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS, Granite-MoE, PhiMoE, JetMoE, Qwen3-Next, ERNIE 4.5 MoE, "
        "FlexOlmo, Flint). Train on the "
        "language-modelling loss alone: with TRL's trainers pass router_aux_loss_coef=0.0 in their config "
        "(SFTConfig(router_aux_loss_coef=0.0), DPOConfig, KTOConfig), which otherwise takes the model config's "
        "coefficient; elsewhere leave output_router_logits off (config.output_router_logits = False, and no "
        "output_router_logits=True in the call)")
