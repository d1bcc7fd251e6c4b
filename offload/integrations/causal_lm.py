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
    2. ``forward`` takes ``**kwargs`` and ``accepts_loss_kwargs`` is true, and ``loss_type`` is
       ``"ForCausalLM"``: ``Trainer`` then passes ``num_items_in_batch``, counts the *shifted* labels
       and does not divide the loss by the accumulation steps, exactly as for the plain model.
    3. ``state_dict`` / ``load_state_dict`` use the Hugging Face names, so a checkpoint's weights
       are a ``from_pretrained`` folder's and ``resume_from_checkpoint`` loads them back; so do a
       parent module's (a LightningModule's), under its prefix (Note: [Hugging Face names at any depth]).
       ``named_parameters`` keeps the stages' names (``offloaded.3.layer.mlp.up_proj.weight``): the
       trainers only group and order the parameters by them, in the model's own order.
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
       computes the loss on the device instead.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ..model import OffloadModel, engine_of
from ..optimizer import OffloadOptimizer
from .peft import peft_base_model
from .transformers_loading import load_causal_lm
from .transformers_batch import LAST_HIDDEN_STATE
from .transformers_stages import CausalLMSequential, causal_lm_sequential

try:
    from safetensors.torch import save_file
    from transformers import PreTrainedModel
    from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        'offload.integrations.causal_lm needs Hugging Face transformers 5: pip install -e ".[transformers]"'
    ) from error

__all__ = ["OffloadedCausalLM"]

#: Keyword arguments of a Hugging Face forward that change nothing here. The padding-free
#: collators' sequence boundaries (``cu_seq_lens_*``, ``max_length_*``, ``seq_idx``) serve the
#: flash-attention kernels; the mask functions find the same boundaries in ``position_ids``.
_IGNORED = {"use_cache", "return_dict", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
            "output_attentions", "output_hidden_states", "logits_to_keep"}


class OffloadedCausalLM(PreTrainedModel):
    """A Hugging Face causal LM whose parameters live in host memory, for the Hugging Face trainers.

    ``Trainer(model=OffloadedCausalLM(hf_model, device="cuda", num_slices=8), ...)`` trains it as it
    trains ``hf_model``, with the same losses and weights bit for bit on the CPU (``docs/trainer.md``):
    the trainer moves it with ``.to(device)`` (the compute device; the parameters stay on the host),
    saves Hugging Face folders that ``from_pretrained`` loads, and resumes from them. Build the
    optimizer with :meth:`offload_optimizer` and hand it over with ``optimizers=(optimizer, None)``:
    the trainer's own AdamW works too, but steps the host copies in ``step()``, on the critical path.

    The loss is computed from the logits as the model computes it (``loss_function`` with
    ``num_items_in_batch``). With ``loss_chunk_tokens`` the head computes it instead, a chunk of
    tokens at a time, without the batch's logits on the device (Note: [Chunked loss] in
    ``offload/integrations/transformers_stages.py``); the output then has no logits, and the loss equals
    the model's to float32 rounding.

    Args:
        model: a ``transformers`` causal LM that ``causal_lm_sequential`` supports, or a ``PeftModel`` of one
            (its adapters train; :meth:`save_pretrained` writes them).
        device: the compute device (``.to(device)`` moves it later).
        loss_chunk_tokens: compute the loss in the head, this many tokens at a time (see above).
        untie_embeddings: as for ``causal_lm_sequential``.
        options: the other arguments of :class:`~offload.OffloadModel` (``num_slices``, ``compute_dtype``,
            ``resident_slices``, ...).

    Raises:
        ValueError: what ``causal_lm_sequential`` or ``OffloadModel`` refuse.

    Example::

        hf = AutoModelForCausalLM.from_pretrained(path)
        model = OffloadedCausalLM(hf, device="cuda", num_slices=8, compute_dtype=torch.bfloat16)
        Trainer(model=model, args=args, train_dataset=data, optimizers=(model.offload_optimizer(args), None)).train()
    """

    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    accepts_loss_kwargs = True  # Note: [What the trainers read from the model], rule 2
    _keys_to_ignore_on_save = None

    def __init__(self, model: nn.Module, device: torch.device | str | int, *, loss_chunk_tokens: int | None = None,
                 untie_embeddings: bool = False, **options: Any) -> None:
        layers = causal_lm_sequential(model, loss_chunk_tokens=loss_chunk_tokens, untie_embeddings=untie_embeddings)
        self._adopt(OffloadModel(layers, device, **options), model)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], device: torch.device | str | int,  # type: ignore[override]
                        **options: Any) -> OffloadedCausalLM:
        """Load a Hugging Face model folder slice by slice into the host copies
        (:func:`~offload.integrations.transformers.load_causal_lm`, whose arguments it takes), never
        the whole model in RAM beside them."""
        offloaded, hf_model = load_causal_lm(path, device, **options)
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
        self.config = hf_model.config
        self.generation_config = getattr(hf_model, "generation_config", None)
        self.name_or_path = getattr(hf_model, "name_or_path", "")
        self.loss_type = "ForCausalLM"
        self.model_tags = None
        self.activation_checkpointing_requested = False
        object.__setattr__(self, "stages", _stages_of(offloaded, hf_model))
        # Note: [Hugging Face names at any depth]
        self._loading_under: list[tuple[str, list[str]]] = []  # (prefix, the load's error messages)
        self.register_state_dict_post_hook(_save_in_hf_names)
        # The public register_load_state_dict_pre_hook (newer torch) registers exactly this.
        self._register_load_state_dict_pre_hook(_load_in_hf_names, with_module=True)
        self.register_load_state_dict_post_hook(_report_in_hf_names)

    # -- what the trainers call ----------------------------------------------------------------

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """The compute device (the parameters are on ``offload_device``)."""
        return self.offloaded.device

    @property
    def base_model(self) -> _HiddenStates:  # type: ignore[override]
        """Runs the offloaded stages to the normed last hidden states (rule 6 of the note)."""
        return _HiddenStates(self)

    def get_input_embeddings(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    def gradient_checkpointing_enable(self, *args: Any, **kwargs: Any) -> None:
        """Accepted: offloaded slices are recomputed in backward already (rule 5 of the note)."""
        self.activation_checkpointing_requested = True

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_requested = False

    activation_checkpointing_enable = gradient_checkpointing_enable
    activation_checkpointing_disable = gradient_checkpointing_disable

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.activation_checkpointing_requested

    is_activation_checkpointing = is_gradient_checkpointing

    def enable_input_require_grads(self) -> None:
        """Accepted: nothing to do (rule 5 of the note)."""

    def disable_input_require_grads(self) -> None:
        """Accepted: nothing to do."""

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """As ``PreTrainedModel.num_parameters``, counted without waiting for pending host updates
        (the trainer asks every step, while ``OffloadOptimizer`` may still be updating)."""
        engine = engine_of(self.offloaded)
        embeddings = {id(m.weight) for s in engine.slices for m in s.modules() if isinstance(m, nn.Embedding)}
        return sum(p.numel() for p in dict.fromkeys(engine.parameters())
                   if not (exclude_embeddings and id(p) in embeddings) and (p.requires_grad or not only_trainable))

    def tie_weights(self, *args: Any, **kwargs: Any) -> None:
        """Tied embeddings stay tied by construction (``causal_lm_sequential``); nothing to do."""

    def offload_optimizer(self, args: Any, **options: Any) -> OffloadOptimizer:
        """The optimizer ``transformers.Trainer`` would build from ``args`` (a ``TrainingArguments``,
        ``SFTConfig`` included), as an :class:`~offload.OffloadOptimizer` that steps the host copies
        beside the next forward: the same class and hyperparameters (``optim``, ``learning_rate``,
        the Adam betas and epsilon, ``fused`` for ``adamw_torch_fused``, the default) and the same
        two groups, ``weight_decay`` for the parameters the Trainer decays and none for biases and
        norms. Hand it to the trainer with ``optimizers=(optimizer, None)``: the trainer then builds
        its learning-rate schedule (warm-up included) over it.

        Args:
            args: the trainer's arguments.
            options: :class:`~offload.OffloadOptimizer`'s own (``num_threads``, ``disk_tier``).

        Raises:
            ValueError: an ``optim`` the Trainer builds from the model itself (GaLore, LOMO, ...), which
                cannot step slice by slice; ``update_in_backward`` (:func:`_refuse_update_in_backward`).
        """
        from transformers import Trainer

        _refuse_update_in_backward(options)

        optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, self)
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)) or {
                "params", "model", "optimizer_dict"} & set(kwargs):
            raise ValueError(f"optim={args.optim!r} builds its optimizer from the whole model; OffloadOptimizer "
                             "steps one slice at a time. Use an optimizer such as adamw_torch_fused (the default)")
        return OffloadOptimizer(self.offloaded, optimizer_class, _decay_groups(self, args.weight_decay), **options,
                                **kwargs)

    @property
    def peft_config(self) -> Any:
        if self.peft_model is None:
            raise AttributeError("peft_config")
        return self.peft_model.peft_config

    @peft_config.setter
    def peft_config(self, value: Any) -> None:
        # PEFT's tuners set it on the model they wrap: get_peft_model(OffloadedCausalLM(...)), or TRL's
        # SFTTrainer(peft_config=...). Their adapters would be named by the stages, not by the model.
        raise ValueError(
            "PEFT cannot wrap an OffloadedCausalLM: the adapters it saves would be named by the offloaded stages "
            "(offloaded.1.layer...) and would not load into the Hugging Face model. Add the adapters first and "
            "wrap the PeftModel: OffloadedCausalLM(peft.get_peft_model(hf_model, LoraConfig(...)), device=...), "
            "and give TRL's SFTTrainer that model without peft_config"
        )

    # -- forward -------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                num_items_in_batch: Any = None, **kwargs: Any) -> CausalLMOutputWithPast:
        """The model's forward: logits, and the loss when ``labels`` (or ``shift_labels``) are given,
        summed over tokens and divided by ``num_items_in_batch`` when the trainer passes it, as the
        model's ``ForCausalLMLoss`` does.

        Raises:
            TypeError: no ``input_ids``, or a keyword the offloaded stages cannot honour
                (``inputs_embeds``, ``output_router_logits=True``, ...).
        """
        # shift_labels among the keywords, as in the model's signature: Trainer takes every argument
        # named like a label for a label its batches must hold before it computes an eval loss.
        shift_labels = kwargs.pop("shift_labels", None)
        batch = self._batch(input_ids, attention_mask, position_ids, kwargs)
        chunked = self.stages.loss_chunk_tokens is not None
        if labels is None and shift_labels is None:
            if chunked:
                raise TypeError("this OffloadedCausalLM computes the loss in its head (loss_chunk_tokens): pass labels")
            return CausalLMOutputWithPast(logits=self.offloaded(batch))
        if chunked:
            sums = self.offloaded({**batch, "labels": labels, "shift_labels": shift_labels})
            count = num_items_in_batch
            if count is None:
                count = CausalLMSequential.count_loss_tokens(labels, shift_labels=shift_labels)
            if isinstance(count, torch.Tensor):
                count = count.to(sums.device)
            return CausalLMOutputWithPast(loss=sums.sum() / count)
        logits = self.offloaded(batch)
        loss = self.hf_model.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                           num_items_in_batch=num_items_in_batch, shift_labels=shift_labels)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _batch(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        refused = sorted(key for key, value in kwargs.items()
                         if key not in _IGNORED and value is not None and value is not False)
        if input_ids is None or refused or kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            what = "input_ids" if input_ids is None else ", ".join(
                refused or [k for k in ("output_attentions", "output_hidden_states") if kwargs.get(k)])
            raise TypeError(
                f"OffloadedCausalLM.forward takes input_ids, attention_mask, position_ids, labels (or shift_labels) "
                f"and num_items_in_batch; it cannot honour {what}. With transformers.Trainer keep "
                "remove_unused_columns=True (the default) so that other dataset columns are dropped"
            )
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return {key: value for key, value in batch.items() if value is not None}

    # -- saving and loading --------------------------------------------------------------------

    def save_pretrained(self, save_directory: str | os.PathLike[str], *args: Any,  # type: ignore[override]
                        is_main_process: bool = True, state_dict: Mapping[str, torch.Tensor] | None = None,
                        **kwargs: Any) -> None:
        """Write a folder that ``AutoModelForCausalLM.from_pretrained`` loads: the config, the
        generation config and the weights, one safetensors shard per slice, written from the host
        copies themselves (no copy of the model is made). A PEFT model writes its adapters instead (``PeftModel.save_pretrained``).
        A tied output embedding is written once, as ``from_pretrained`` expects."""
        if not is_main_process:
            return
        if self.peft_model is not None:
            self.offloaded._settle()
            self.peft_model.save_pretrained(save_directory, *args, **kwargs)
            return
        os.makedirs(save_directory, exist_ok=True)
        self.config.save_pretrained(save_directory)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(save_directory)
        names = _hf_names(self)
        self.offloaded._settle()
        _write_shards(save_directory, _shards(self.offloaded, names))


class _HiddenStates:
    """``OffloadedCausalLM.base_model``: the decoder's output, as TRL's fused LM head calls it."""

    def __init__(self, model: OffloadedCausalLM) -> None:
        self.model = model

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, **kwargs: Any) -> BaseModelOutputWithPast:
        batch = self.model._batch(input_ids, attention_mask, position_ids, kwargs)
        hidden = self.model.offloaded({**batch, LAST_HIDDEN_STATE: True})
        weight = self.model.get_output_embeddings().weight
        if hidden.device != weight.device:
            # The caller projects them through the host copy of lm_head, outside the device's autocast:
            # they go to the host in the weight's dtype (a half-precision hidden state would not multiply
            # a float32 weight there).
            hidden = hidden.to(weight.device, weight.dtype)
        return BaseModelOutputWithPast(last_hidden_state=hidden)


def _shards(offloaded: OffloadModel, names: dict[str, str]) -> list[dict[str, torch.Tensor]]:
    """The weights ``save_pretrained`` writes, one shard a slice (slices with none left out): each
    host copy under its Hugging Face name (``names``), a tied one once, under its first (the
    embedding's) name, as ``from_pretrained`` expects."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    shards: list[dict[str, torch.Tensor]] = []
    for s in engine_of(offloaded).slices:
        shard: dict[str, torch.Tensor] = {}
        for name, layer in zip(s.names, s.layers):
            for key, tensor in layer.state_dict(prefix=f"{name}.").items():
                place = (tensor.data_ptr(), tuple(tensor.shape))
                if place not in seen:
                    seen.add(place)
                    shard[names[key]] = tensor
        shards.append(shard)
    return [shard for shard in shards if shard]


def _write_shards(save_directory: str | os.PathLike[str], shards: list[dict[str, torch.Tensor]]) -> None:
    """Write ``shards`` as safetensors files into ``save_directory`` with their index, as
    ``save_pretrained`` names them (``model.safetensors`` alone, or ``model-0000i-of-0000n``)."""
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    weight_map = {}
    total = 0
    for file, shard in zip(files, shards):
        # The host copies themselves: each has a storage of its own (Note: [A storage per host copy]).
        save_file({key: t.detach() for key, t in shard.items()}, os.path.join(save_directory, file),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    if len(files) > 1:
        with open(os.path.join(save_directory, "model.safetensors.index.json"), "w") as index:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, index, indent=2)
    else:  # a single file replaces an older sharded save in the same folder
        stale = os.path.join(save_directory, "model.safetensors.index.json")
        if os.path.exists(stale):
            os.remove(stale)


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


def _hf_names(model: OffloadedCausalLM) -> dict[str, str]:
    """The OffloadModel's state_dict keys -> the Hugging Face model's."""
    engine = engine_of(model.offloaded)
    keys = [key for s in engine.slices for name, layer in zip(s.names, s.layers)
            for key in layer.state_dict(prefix=f"{name}.", keep_vars=True)]
    return {key: model.stages.hf_name(key) for key in keys}


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
#        holding both names would load one of them silently.
#     3. The load post-hook names the keys the stages found missing, and those the stages' errors
#        name (a size mismatch), by their Hugging Face names. It is given neither the prefix nor the
#        errors: the pre-hook leaves both on the model (``_loading_under``), a stack, since a module
#        that two parents share is loaded twice, once under each, one after the other.
#     ``keep_vars`` and ``assign`` reach the stages as for any module; ``strict`` is applied by
#     ``load_state_dict()`` once the walk is done, to the names the hooks report.


def _save_in_hf_names(model: OffloadedCausalLM, state_dict: dict[str, Any], prefix: str,
                      local_metadata: dict[str, Any]) -> None:
    """Rule 1 of Note: [Hugging Face names at any depth]."""
    for stage_key, hf_name in _hf_names(model).items():
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
    for stage_key, hf_name in _hf_names(model).items():
        if prefix + hf_name in state_dict:
            state_dict[stages + stage_key] = state_dict.pop(prefix + hf_name)
    model._loading_under.append((prefix, error_msgs))


def _report_in_hf_names(model: OffloadedCausalLM, incompatible_keys: _IncompatibleKeys) -> None:
    """Rule 3 of Note: [Hugging Face names at any depth]."""
    prefix, error_msgs = model._loading_under.pop()
    renamed = {f"{prefix}offloaded.{stage_key}": prefix + hf_name for stage_key, hf_name in _hf_names(model).items()}
    incompatible_keys.missing_keys[:] = [renamed.get(key, key) for key in incompatible_keys.missing_keys]
    stage_name = re.compile(rf"{re.escape(prefix)}offloaded\.[\w.]*\w")
    error_msgs[:] = [stage_name.sub(lambda found: renamed.get(found.group(0), found.group(0)), message)
                     for message in error_msgs]


def _decay_groups(model: OffloadedCausalLM, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in the Trainer's two groups: ``weight_decay`` for those it decays, none
    for biases and norms (an empty group left out)."""
    from transformers import Trainer

    # Trainer.get_decay_parameter_names reads nothing of the trainer: the rule is the Trainer's own.
    decayed = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for name, p in named if name in decayed], "weight_decay": weight_decay},
              {"params": [p for name, p in named if name not in decayed], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _refuse_update_in_backward(options: dict[str, Any]) -> None:
    """Raise for ``update_in_backward``: between backward and ``step()`` the Trainer rewrites every
    gradient in place (it clips them, or, to log their norm, clips them at an infinite norm: a
    multiplication by one that OffloadOptimizer's check cannot tell from a real change)."""
    if options.get("update_in_backward"):
        raise ValueError(
            "update_in_backward cannot be used under transformers.Trainer: between backward and optimizer.step() "
            "the Trainer rewrites every gradient in place (clip_grad_norm_; transformers 5.24 does so at an infinite "
            "norm when max_grad_norm=0, to log the norm), after the update has read them. Leave update_in_backward "
            "out here; use it in a loop of your own or with Accelerate or Lightning, without clipping")
