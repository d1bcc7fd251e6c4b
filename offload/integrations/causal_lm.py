"""An offloaded causal LM shaped like a Hugging Face one, for ``transformers.Trainer`` and TRL's ``SFTTrainer``.

:class:`OffloadedCausalLM` wraps the stages of :func:`~offload.integrations.transformers.causal_lm_sequential`
in an :class:`~offload.OffloadModel` and answers what the trainers ask of a model: ``forward(input_ids,
attention_mask, labels, num_items_in_batch, ...)`` returning a ``CausalLMOutputWithPast`` whose loss is
the model's own ``ForCausalLMLoss``; ``config``, ``generation_config``, ``loss_type``, the embeddings,
``base_model`` (for TRL's fused LM head), ``save_pretrained`` and ``state_dict`` in Hugging Face names.
It holds no layers of its own: the OffloadModel holds the model's modules, and the Hugging Face model
they came from trains along.

Note: [What the trainers read from the model]
    1. It is a ``PreTrainedModel`` so that ``Trainer.save_model`` and its checkpoints call
       :meth:`OffloadedCausalLM.save_pretrained` (a Hugging Face folder, written slice by slice)
       rather than ``safetensors.save_file(model.state_dict())``. ``PreTrainedModel.__init__`` is not
       run: it would check the attention implementation of the *shared* config against this class
       and could change the model's; the attributes the trainers read are set here instead.
    2. ``forward`` takes ``**kwargs`` and ``accepts_loss_kwargs`` is true, and ``loss_type`` is the
       wrapped model's (``"ForCausalLM"``; ``None`` for GPT-2, whose class name names no loss):
       ``Trainer`` then passes ``num_items_in_batch``, counts the labels (shifted for
       ``"ForCausalLM"``, not for ``None``) and does not divide the loss by the accumulation steps,
       exactly as for the plain model.
    3. ``state_dict`` / ``load_state_dict`` use the Hugging Face names, so a checkpoint's weights
       are a ``from_pretrained`` folder's and ``resume_from_checkpoint`` loads them back; so do a
       parent module's (a LightningModule's), under its prefix (Note: [Hugging Face names at any depth]).
       ``named_parameters`` keeps the stages' names (``offloaded.3.layer.mlp.up_proj.weight``): the
       trainers only group and order the parameters by them, in the model's own order.
       ``get_parameter``, ``get_buffer`` and ``get_submodule`` take both (Note: [Two naming schemes]).
    4. ``.to(device)`` reaches ``OffloadModel._apply``: the compute device moves, the parameters
       stay on the host (Note: [Moving an OffloadModel] in ``offload/modeling/placement.py``).
    5. Activation checkpointing (``gradient_checkpointing=True``, ``SFTConfig``'s default) is
       accepted and does nothing more: every slice but the last is recomputed in backward already.
       ``enable_input_require_grads`` is not needed either (it exists for reentrant checkpointing
       of a frozen embedding's output) and is accepted.
    6. ``base_model`` returns the normed last hidden states of the offloaded stages
       (``batch["last_hidden_state"] = True``): TRL's fused head projects them through
       ``get_output_embeddings().weight``, the host copy of ``lm_head``, itself: on the host, in
       the weight's dtype, where the compute device is another. Correct, and bit for bit the plain
       model's on the CPU, but on a GPU that projection (``B x T x hidden`` by ``vocab x hidden``)
       runs on the CPU: for a large vocabulary, ``transformers.Trainer`` with ``loss_chunk_tokens``
       computes the loss on the device instead. A PEFT adapter on ``lm_head`` is refused there: the
       caller would project through its frozen base weight (Note: [What the trainers cannot get from
       the model], rule 1, in ``transformers_refusals.py``, with the other refusals).
    7. ``_get_name()`` is the wrapped model's class name (``LlamaForCausalLM``): with
       ``label_smoothing_factor`` the Trainer takes the labels out of the batch and shifts them for
       its label smoother only for a model so named in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``. Nothing
       else in transformers, TRL, PEFT or Accelerate reads it; torch names the module by it in
       ``repr`` (which keeps ``OffloadedCausalLM`` here) and in a few attribute errors.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..model import OffloadModel, engine_of
from . import causal_lm_configs, causal_lm_embeddings, causal_lm_guards, causal_lm_optimizer, hf_names
from .causal_lm_switches import TrainerSwitches
from .peft import peft_base_model, peft_names_as_hf
from .transformers_loading import load_causal_lm, stored_into_stages
from .transformers_batch import LAST_HIDDEN_STATE, ROUTER_LOGITS
from .transformers_refusals import (MissingLogits, attribute_or_advice, forward_refusal, refuse_adapter_on_head,
                                    refuse_packed_sequences, refuse_router_logits, warn_of_cache,
                                    warn_of_layer_outputs)
from .transformers_saving import positional_save_arguments, save_causal_lm, save_options
from .transformers_router import flat_router_logits, router_logits_asked, with_router_loss
from .transformers_stages import CausalLMSequential, causal_lm_sequential, packed_sequence_keywords

try:
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MoeModelOutputWithPast
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    from . import install_hint

    raise ImportError(
        f"offload.integrations.causal_lm needs Hugging Face transformers 5: {install_hint('transformers')}"
    ) from error

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # pragma: no cover - older transformers 5 sliced in each model: by a count or by positions
    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, kept, :]

__all__ = ["OffloadedCausalLM"]

#: Keyword arguments of a Hugging Face forward that change nothing here. The padding-free
#: collators' sequence boundaries (``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``) serve the
#: flash-attention kernels, and the mask functions find the same boundaries in ``position_ids``;
#: those a convolution or linear-attention layer reads are refused first (rule 5 of Note: [What the
#: trainers cannot get from the model]). (``return_dict`` and ``logits_to_keep`` change the output:
#: ``forward`` honours them; ``output_attentions=False`` and the like pass as any ``False``.)
_IGNORED = {"use_cache", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}

class OffloadedCausalLM(TrainerSwitches, PreTrainedModel):
    """A Hugging Face causal LM whose parameters live in host memory, for the Hugging Face trainers.

    ``Trainer(model=OffloadedCausalLM(hf_model, device="cuda", num_slices=8), ...)`` trains it as it
    trains ``hf_model``, with the same losses and weights bit for bit on the CPU (``docs/trainer.md``):
    the trainer moves it with ``.to(device)`` (the compute device; the parameters stay on the host),
    saves Hugging Face folders that ``from_pretrained`` loads, and resumes from them. Build the
    optimizer with :meth:`offload_optimizer` and hand it over with ``optimizers=(optimizer, None)``:
    the trainer's own AdamW works too, but steps the host copies in ``step()``, on the critical path.

    The loss is computed from the logits as the model computes it (``loss_function`` with
    ``num_items_in_batch``). With ``loss_chunk_tokens`` the head computes it instead, a chunk of tokens
    at a time, without the batch's logits on the device (Note: [Chunked loss] in ``transformers_stages.py``);
    the output then has no logits (a placeholder that raises at its first use, rule 4 of Note: [What the
    trainers cannot get from the model]), and the loss equals the model's to float32 rounding.

    Args:
        model: a ``transformers`` causal LM that ``causal_lm_sequential`` supports, or a ``PeftModel`` of one
            (its adapters train; :meth:`save_pretrained` writes them).
        device: the compute device (``.to(device)`` moves it later).
        loss_chunk_tokens: compute the loss in the head, this many tokens at a time (see above).
        untie_embeddings: as for ``causal_lm_sequential``.
        options: the other arguments of :class:`~offload.OffloadModel` (``num_slices``, ``compute_dtype``,
            ``resident_slices``, ...).

    Raises:
        ValueError: what ``causal_lm_sequential`` (PEFT's trainable tokens on a tied embedding
            among them) or ``OffloadModel`` refuse.

    Example::

        hf = AutoModelForCausalLM.from_pretrained(path)
        model = OffloadedCausalLM(hf, device="cuda", num_slices=8, compute_dtype=torch.bfloat16)
        Trainer(model=model, args=args, train_dataset=data, optimizers=(model.offload_optimizer(args), None)).train()
    """

    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    accepts_loss_kwargs = True  # Note: [What the trainers read from the model], rule 2
    _keys_to_ignore_on_save = None
    __getattr__ = attribute_or_advice
    __setattr__, add_module = causal_lm_guards.set_attribute, causal_lm_guards.add_module  # Note: [Around the stages]
    register_parameter = causal_lm_guards.register_parameter
    # The model's own, not copies: save_pretrained writes the model's (Note: [The model's configs, not copies]).
    config, generation_config = causal_lm_configs.config, causal_lm_configs.generation_config
    vocab_size = causal_lm_configs.vocab_size  # resize_token_embeddings changes the model's

    def __init__(self, model: nn.Module, device: torch.device | str | int, *, loss_chunk_tokens: int | None = None,
                 untie_embeddings: bool = False, **options: Any) -> None:
        layers = causal_lm_sequential(model, loss_chunk_tokens=loss_chunk_tokens, untie_embeddings=untie_embeddings,
                                      router_logits=None)  # where the family has a router loss (Note: [Router logits])
        self._adopt(OffloadModel(layers, device, **options), model)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], device: torch.device | str | int,  # type: ignore[override]
                        **options: Any) -> OffloadedCausalLM:
        """Load a Hugging Face model folder slice by slice into the host copies
        (:func:`~offload.integrations.transformers.load_causal_lm`, whose arguments it takes), never
        the whole model in RAM beside them."""
        offloaded, hf_model = load_causal_lm(path, device, **{"router_logits": None, **options})
        model = cls.__new__(cls)
        model._adopt(offloaded, hf_model)
        return model

    def _adopt(self, offloaded: OffloadModel, model: nn.Module) -> None:
        nn.Module.__init__(self)  # not PreTrainedModel.__init__: rule 1 of the note
        self.offloaded = offloaded
        hf_model = peft_base_model(model) or model
        # Not submodules: the stages hold their modules already, and .to() must reach them once.
        object.__setattr__(self, "hf_model", hf_model)
        object.__setattr__(self, "peft_model", model if model is not hf_model else None)
        self.name_or_path = getattr(hf_model, "name_or_path", "")
        self.loss_type = getattr(hf_model, "loss_type", None)  # rule 2 of the note
        self.model_tags = None
        # nn.Module.__init__ set train mode; the model's modules keep theirs (eval after from_pretrained).
        self.training = offloaded.training = hf_model.training
        self.activation_checkpointing_requested = False
        object.__setattr__(self, "stages", _stages_of(offloaded, hf_model))
        # Note: [Hugging Face names at any depth]
        self._loading_under: list[tuple[str, list[str], int]] = []  # (prefix, error messages, unexpected so far)
        self.register_state_dict_post_hook(_save_in_hf_names)
        # The public register_load_state_dict_pre_hook (newer torch) registers exactly this.
        self._register_load_state_dict_pre_hook(_load_in_hf_names, with_module=True)
        self.register_load_state_dict_post_hook(_report_in_hf_names)

    # -- what the trainers call ----------------------------------------------------------------

    def _get_name(self) -> str:
        """The wrapped model's class name, by which the Trainer knows a causal LM (rule 7 of the note)."""
        return type(self.hf_model).__name__

    def __repr__(self) -> str:
        return type(self).__name__ + super().__repr__().removeprefix(self._get_name())

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """The compute device (the parameters are on ``offload_device``)."""
        return self.offloaded.device

    @property
    def process_group(self) -> Any:
        """The process group gradients are averaged over (``process_group=``), or ``None``."""
        return self.offloaded.process_group

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """:meth:`OffloadModel.no_sync`: data-parallel gradient accumulation, as under
        ``DistributedDataParallel.no_sync()`` (docs/distributed.md)."""
        return self.offloaded.no_sync()

    @property
    def base_model(self) -> _HiddenStates:  # type: ignore[override]
        """Runs the offloaded stages to the normed last hidden states (rule 6 of the note)."""
        return _HiddenStates(self)

    # The model's own, settled first and laid out again after (Note: [The embeddings through the
    # model's own methods] in causal_lm_embeddings.py): hf_model is no submodule.
    get_input_embeddings = causal_lm_embeddings.get_input_embeddings
    get_output_embeddings = causal_lm_embeddings.get_output_embeddings
    set_input_embeddings = causal_lm_embeddings.set_input_embeddings
    set_output_embeddings = causal_lm_embeddings.set_output_embeddings
    resize_token_embeddings = causal_lm_embeddings.resize_token_embeddings
    tie_weights = causal_lm_embeddings.tie_weights

    # The wrapper's names and the Hugging Face model's, which state_dict() uses (Note: [Two naming
    # schemes] in hf_names.py): nn.Module's lookup knows only the first.
    get_parameter, get_buffer, get_submodule = hf_names.get_parameter, hf_names.get_buffer, hf_names.get_submodule

    def set_attn_implementation(self, attn_implementation: str | dict[str, str]) -> None:
        """The model's own: its checks, and the config the stages read at every call."""
        self.hf_model.set_attn_implementation(attn_implementation)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """As ``PreTrainedModel.num_parameters``, counted without waiting for pending host updates
        (the trainer asks every step, while ``OffloadOptimizer`` may still be updating)."""
        engine = engine_of(self.offloaded)
        embeddings = {id(m.weight) for s in engine.slices for m in s.modules() if isinstance(m, nn.Embedding)}
        return sum(p.numel() for p in dict.fromkeys(engine.parameters())
                   if not (exclude_embeddings and id(p) in embeddings) and (p.requires_grad or not only_trainable))

    def memory_footprint(self) -> Any:
        """Every host, pinned, device and disk byte the offloaded model holds, by category
        (:meth:`OffloadModel.memory_footprint`): ``get_memory_footprint``, Hugging Face's, counts
        the parameters and buffers alone."""
        return self.offloaded.memory_footprint()

    # The optimizer the trainer would build, as an OffloadOptimizer (causal_lm_optimizer.py).
    offload_optimizer = causal_lm_optimizer.offload_optimizer

    peft_config = causal_lm_guards.peft_config  # the PeftModel's; PEFT around the wrapper refused

    # -- forward -------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_items_in_batch: Any = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """The model's forward: logits, and the loss when ``labels`` are given (``shift_labels`` alone
        give none, as in the model; with ``loss_chunk_tokens`` either gives it), summed over tokens and
        divided by ``num_items_in_batch`` when the trainer passes it, as the model's ``ForCausalLMLoss`` does. ``logits_to_keep`` keeps the logits of the last positions
        (or of those a tensor names) and ``return_dict=False`` returns a tuple, as in the model. A
        mixture of experts asked for its router logits (``output_router_logits``, in the call or else
        the config) returns them with the load-balancing ``aux_loss``, added to the loss by the
        model's ``router_aux_loss_coef`` (Note: [Router logits] in ``transformers_router.py``).

        Raises:
            TypeError: no ``input_ids``, or a keyword the offloaded stages cannot honour
                (``inputs_embeds``, ``output_router_logits=True`` in the call or the config of a
                family without a load-balancing loss, ``output_hidden_states=True`` or
                ``output_attentions=True`` in the call, ...); with
                ``loss_chunk_tokens``, no labels or a ``logits_to_keep``. (The same two in the config
                are warned of: the outputs hold ``None`` there.)
            ValueError: a packed batch's sequence boundaries (``seq_idx``, ``cu_seq_lens_q``) that a
                convolution or linear-attention layer needs (LFM2, Qwen3-Next).
            RuntimeError: a hook on the Hugging Face model or its decoder, which the stages bypass.
        """
        # shift_labels among the keywords, as in the model's signature: Trainer takes every argument
        # named like a label for a label its batches must hold before it computes an eval loss.
        shift_labels = kwargs.pop("shift_labels", None)
        return_dict = kwargs.pop("return_dict", None)
        logits_to_keep = kwargs.pop("logits_to_keep", 0)
        batch = self._batch(input_ids, attention_mask, position_ids, kwargs)
        if self.stages.loss_chunk_tokens is not None:
            output = _chunked_loss(self.offloaded, self.hf_model, batch, labels, shift_labels, num_items_in_batch,
                                   logits_to_keep)
        else:
            logits = self.offloaded(batch)
            if ROUTER_LOGITS in batch:
                logits, *router = logits
            if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
                # The model slices the hidden states before lm_head; the head here projects every
                # position, so the kept logits are sliced after it: the same shape, the rows of the
                # full projection (a product of fewer rows may round differently, about 1 float32 ulp);
                # contiguous, as the model's product is (its loss views them).
                logits = slice_logits_to_keep(logits, logits_to_keep).contiguous()
            loss = None
            if labels is not None:  # shift_labels alone give no loss, as in the model
                loss = self.hf_model.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                                   num_items_in_batch=num_items_in_batch, shift_labels=shift_labels)
            output = CausalLMOutputWithPast(loss=loss, logits=logits)
            if ROUTER_LOGITS in batch:
                output = with_router_loss(self.hf_model, output, router, attention_mask)
        return _as_returned(output, return_dict, self.config)

    def _batch(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        causal_lm_guards.refuse_bypassed_hooks(self)  # Note: [Around the stages], rule 2
        return _batch_of(self.config, self.stages[0].router_logits, input_ids, attention_mask, position_ids, kwargs)

    # -- saving and loading --------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike[str], *args: Any,  # type: ignore[override]
                        is_main_process: bool = True, state_dict: Mapping[str, torch.Tensor] | None = None,
                        **kwargs: Any) -> None:
        """Write a folder that ``AutoModelForCausalLM.from_pretrained`` loads, as the model's own
        ``save_pretrained`` writes it (the config, the generation config, the weights in its stored
        names and layouts, a tied output embedding once, no older weight file left beside them), but
        for the shards: one a slice, written from the host copies themselves, no copy of the model
        made (:func:`~offload.integrations.transformers_saving.save_causal_lm`). A PEFT model writes
        its adapters instead (``PeftModel.save_pretrained``), one injected after wrapping as its PeftModel
        would (Note: [Around the stages] in ``causal_lm_guards.py``); once ``merge_and_unload()`` took
        the adapters out, the whole model is written, however they were added. A ``state_dict`` is written as the
        model's (or the PeftModel's) ``save_pretrained`` writes one: those tensors, under its names.

        Raises:
            TypeError: slice by slice, an argument but ``max_shard_size`` and ``variant`` that would
                change what ``save_pretrained`` does (:func:`~.transformers_saving.save_options`)."""
        args, is_main_process, state_dict = positional_save_arguments(args, is_main_process, state_dict)
        if not is_main_process:
            return
        self.offloaded._settle()
        if self.peft_model is not None and causal_lm_guards.holds_adapters(self.hf_model):
            self.peft_model.save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        elif (adapters := causal_lm_guards.injected_adapters(self.hf_model)) is not None:  # Note: [Around the stages]
            causal_lm_guards.save_injected_adapter(self.hf_model, adapters, save_directory, args, state_dict, kwargs)
        elif state_dict is not None:
            self.hf_model.save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        else:
            save_causal_lm(self.offloaded, self.hf_model, save_directory, **save_options(args, kwargs))


class _HiddenStates:
    """``OffloadedCausalLM.base_model``: the decoder's output, as TRL's fused LM head calls it."""

    def __init__(self, model: OffloadedCausalLM) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, **kwargs: Any) -> BaseModelOutputWithPast:
        return_dict = kwargs.pop("return_dict", None)
        # The caller projects through the head's weight. The refusal reads the module's type only, so
        # through hf_model, without waiting: the accessor would wait for the whole pending update (and
        # expire every shadow) before the forward, which loads each slice once its update is done.
        refuse_adapter_on_head(self.model.hf_model.get_output_embeddings())
        batch = self.model._batch(input_ids, attention_mask, position_ids, kwargs)
        hidden = self.model.offloaded({**batch, LAST_HIDDEN_STATE: True})
        if ROUTER_LOGITS in batch:
            hidden, *router = hidden
        weight = self.model.get_output_embeddings().weight  # every slice was loaded: nothing is pending
        if hidden.device != weight.device:
            # The caller projects them through the host copy of lm_head, outside the device's autocast:
            # they go to the host in the weight's dtype (a half-precision hidden state would not multiply
            # a float32 weight there).
            hidden = hidden.to(weight.device, weight.dtype)
        output = BaseModelOutputWithPast(last_hidden_state=hidden)
        if ROUTER_LOGITS in batch:  # for the caller's load-balancing loss (TRL's fused head computes it)
            output = MoeModelOutputWithPast(last_hidden_state=hidden, router_logits=flat_router_logits(router))
        return _as_returned(output, return_dict, self.model.config)


def _batch_of(config: Any, carries_router: bool, input_ids: torch.Tensor | None,
              attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
              kwargs: dict[str, Any]) -> dict[str, Any]:
    """The stages' batch from a forward's arguments, asking for the router logits where the call or
    the config asks, as the model does (Note: [Router logits]: the stages ``carries_router``); a
    ``TypeError`` for those they cannot honour, a ``ValueError`` for packed sequences' boundaries
    that a layer would need from the keywords."""
    # Note: [What the trainers cannot get from the model], rules 3, 5 and 6.
    if not carries_router:
        refuse_router_logits(config, kwargs)
    router = router_logits_asked(config, kwargs) and carries_router  # the keyword taken out either way
    refuse_packed_sequences(packed_sequence_keywords(config), config.model_type, kwargs)
    warn_of_layer_outputs(config, kwargs)
    warn_of_cache(kwargs)
    refused = sorted(key for key, value in kwargs.items()
                     if key not in _IGNORED and value is not None and value is not False)
    if input_ids is None or refused:
        raise TypeError(forward_refusal(refused))
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
             ROUTER_LOGITS: router}
    return {key: value for key, value in batch.items() if value is not None and value is not False}


def _chunked_loss(offloaded: OffloadModel, hf_model: nn.Module, batch: dict[str, Any],
                  labels: torch.Tensor | None, shift_labels: torch.Tensor | None, num_items_in_batch: Any,
                  logits_to_keep: int | torch.Tensor) -> CausalLMOutputWithPast:
    """The loss the head computes (``loss_chunk_tokens``), summed and divided as ``ForCausalLMLoss`` does."""
    if labels is None and shift_labels is None:
        raise TypeError(
            "this OffloadedCausalLM computes the loss in its head (loss_chunk_tokens) and returns no logits: pass "
            "labels. transformers.Trainer calls it without them under label_smoothing_factor or compute_loss_func, "
            "which need the logits: build the model without loss_chunk_tokens for those")
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise TypeError("this OffloadedCausalLM computes the loss in its head (loss_chunk_tokens) and returns no "
                        "logits: it cannot honour logits_to_keep")
    sums = offloaded({**batch, "labels": labels, "shift_labels": shift_labels})
    if ROUTER_LOGITS in batch:
        sums, *router = sums
    count = num_items_in_batch
    if count is None:
        count = CausalLMSequential.count_loss_tokens(labels, shift_labels=shift_labels)
    if isinstance(count, torch.Tensor):
        count = count.to(sums.device)
    # Note: [What the trainers cannot get from the model], rule 4: no logits, and any use says so.
    output = CausalLMOutputWithPast(loss=sums.sum() / count, logits=MissingLogits())
    return output if ROUTER_LOGITS not in batch else with_router_loss(hf_model, output, router,
                                                                       batch.get("attention_mask"))


def _as_returned(output: Any, return_dict: bool | None, config: Any) -> Any:
    """``output``, or its tuple (its fields that are not ``None``) where ``return_dict=False`` asks
    for one, else where the config's ``return_dict`` does: as transformers' ``can_return_tuple``."""
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)
    return output if return_dict else output.to_tuple()


def _stages_of(offloaded: OffloadModel, hf_model: nn.Module) -> CausalLMSequential:
    """The OffloadModel's stages as a ``CausalLMSequential`` (for their Hugging Face names); it adds
    no module to either model."""
    engine = engine_of(offloaded)
    layers = [layer for s in engine.slices for layer in s.layers]
    names = [name for s in engine.slices for name in s.names]
    stages = CausalLMSequential(layers, hf_model, layers[-1].loss_chunk_tokens)
    if names != list(stages._modules):  # OffloadModel keeps the Sequential's names: "0", "1", ...
        raise AssertionError(f"unexpected stage names {names[:3]}...")
    return stages


# -- Hugging Face names in state dicts ---------------------------------------------------------------
# Note: [Hugging Face names at any depth]
#     ``state_dict()`` on a parent (a LightningModule) calls each child's ``state_dict()``, but
#     ``load_state_dict()`` on a parent never calls a child's ``load_state_dict()``: it walks the
#     modules itself, running each one's load pre-hooks, ``_load_from_state_dict`` and load
#     post-hooks under the prefix of its keys. So the names change in hooks, which run at any depth:
#     1. The state-dict post-hook renames the model's keys, ``prefix + "offloaded." + stage key``,
#        to ``prefix`` + the Hugging Face name, in place and in order.
#     2. The load pre-hook renames them back before the walk reaches the stages, and takes keys in
#        the stages' names out as unexpected: ``state_dict()`` never writes them, and a state dict
#        holding both names would load one of them silently. It takes a ``PeftModel``'s names as the HF ones.
#     3. The load post-hook names the keys the stages found missing or unexpected (what a ``Linear4bit``
#        saves below its weight, ``weight.absmax``), and those the stages' errors name (a size
#        mismatch), by their Hugging Face names. It is given neither the prefix nor the errors: the
#        pre-hook leaves both on the model (``_loading_under``), with the count of unexpected keys
#        before the walk (those are the caller's and rule 2's), a stack, since a module that two
#        parents share is loaded twice, once under each, one after the other.
#     4. The load pre-hook also takes the stored names and layouts, those ``save_pretrained`` writes
#        (a mixture of experts' fused experts one by one: ``...experts.3.w1.weight``), and converts
#        them into the model's tensors as ``from_pretrained`` does (``stored_into_stages`` in
#        ``transformers_loading.py``): the Trainer's resume loads a checkpoint's weights with
#        ``load_state_dict``. It converts only keys left over once the model's own names are taken:
#        a state dict in those loads as before, and stored names that convert into nothing, or into
#        a tensor given already, stay unexpected.
#     ``keep_vars`` and ``assign`` reach the stages as for any module; ``strict`` is applied by
#     ``load_state_dict()`` once the walk is done, to the names the hooks report.


def _save_in_hf_names(model: OffloadedCausalLM, state_dict: dict[str, Any], prefix: str,
                      local_metadata: dict[str, Any]) -> None:
    """Rule 1 of Note: [Hugging Face names at any depth]."""
    for stage_key, hf_name in hf_names.state_dict_names(model).items():
        key = f"{prefix}offloaded.{stage_key}"
        if key in state_dict:  # a hook of the stages' own may have left it out
            state_dict[prefix + hf_name] = state_dict.pop(key)


def _load_in_hf_names(model: OffloadedCausalLM, state_dict: dict[str, Any], prefix: str,
                      local_metadata: dict[str, Any], strict: bool, missing_keys: list[str],
                      unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Rule 2 of Note: [Hugging Face names at any depth]. ``state_dict`` is the walk's own copy."""
    stages = f"{prefix}offloaded."
    for key in [key for key in state_dict if key.startswith(stages)]:
        unexpected_keys.append(key)
        del state_dict[key]
    names = hf_names.state_dict_names(model)
    peft_names_as_hf(model.peft_model, model.hf_model, state_dict, prefix, names.values())  # [PEFT models], rule 6
    for stage_key, hf_name in names.items():
        if prefix + hf_name in state_dict:
            state_dict[stages + stage_key] = state_dict.pop(prefix + hf_name)
    _load_stored_names(model, state_dict, prefix, error_msgs)
    model._loading_under.append((prefix, error_msgs, len(unexpected_keys)))


def _load_stored_names(model: OffloadedCausalLM, state_dict: dict[str, Any], prefix: str,
                       error_msgs: list[str]) -> None:
    """Rule 4 of Note: [Hugging Face names at any depth]."""
    stages = f"{prefix}offloaded."
    left = {key.removeprefix(prefix): key for key in state_dict
            if key.startswith(prefix) and not key.startswith(stages)}
    if not left:
        return
    given = {key.removeprefix(stages) for key in state_dict if key.startswith(stages)}
    tensors, used, errors = stored_into_stages(model.hf_model, model.stages,
                                               {name: state_dict[key] for name, key in left.items()}, given, prefix)
    for name in used:
        del state_dict[left[name]]
    state_dict.update({stages + stage_key: tensor for stage_key, tensor in tensors.items()})
    error_msgs.extend(errors)


def _report_in_hf_names(model: OffloadedCausalLM, incompatible_keys: _IncompatibleKeys) -> None:
    """Rule 3 of Note: [Hugging Face names at any depth]; nothing after ``load_checkpoint``, which runs no pre-hook."""
    if not model._loading_under:  # its keys are state_dict()'s (Note: [Module load hooks] in checkpoint/contents.py)
        return
    prefix, error_msgs, before = model._loading_under.pop()
    renamed = {f"{prefix}offloaded.{stage_key}": prefix + hf_name
               for stage_key, hf_name in hf_names.state_dict_names(model).items()}
    incompatible_keys.missing_keys[:] = [renamed.get(key, key) for key in incompatible_keys.missing_keys]
    unexpected = incompatible_keys.unexpected_keys
    unexpected[before:] = [renamed.get(key, key) for key in unexpected[before:]]
    stage_name = re.compile(rf"{re.escape(prefix)}offloaded\.[\w.]*\w")
    error_msgs[:] = [stage_name.sub(lambda found: renamed.get(found.group(0), found.group(0)), message)
                     for message in error_msgs]
