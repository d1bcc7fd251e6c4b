"""Hugging Face causal LMs loaded from their safetensors checkpoint straight into an :class:`~offload.OffloadModel`.

:func:`load_causal_lm` is ``from_pretrained`` followed by :func:`~offload.integrations.transformers.causal_lm_sequential`
and ``OffloadModel``, without the model ever existing outside its host copies (Note: [Loading slice
by slice] in ``offload/loading/sequential.py``). What ``from_pretrained`` does besides reading tensors, it does
the same way, with transformers' own functions:

- stored names go through the model's conversion mapping (``gpt_neox``'s ``embed_out`` is
  ``lm_head``; a checkpoint of the base model lacks the ``model.`` prefix); stored tensors that
  name nothing in the model are skipped unread, those older transformers saved (a per-layer
  rotary ``inv_freq``) and those the model says to ignore silently, the others with one warning
  that lists them (GPT-2's ``attn.masked_bias``), as ``from_pretrained`` reports them unexpected;
- experts stored one by one (Mixtral, Qwen2-MoE, Qwen3-MoE) are read into their place in the
  stacked expert tensors (the conversion's ``MergeModulelist`` and ``Concatenate``), one expert
  at a time; other conversions, which would need the whole tensor first, are refused;
- non-persistent buffers (rotary frequencies, Gemma's embedding scale) are computed by the model's
  ``_init_weights``, which ``from_pretrained`` runs on them too, once their host memory exists;
- the model's generation config is the folder's ``generation_config.json``, else one read from
  ``config.json``, as ``from_pretrained`` reads them (``from_config`` derives one from the config
  alone, without the file's end tokens and sampling settings, which a save would then write over);
- the model is returned in eval mode, as ``from_pretrained`` returns it.

:func:`stored_into_stages` converts a state dict in the stored names and layouts (a
``save_pretrained`` folder's tensors) the same way, for ``OffloadedCausalLM.load_state_dict``.
"""

from __future__ import annotations

import inspect
import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..loading.four_bit import quantize_linears
from ..loading.sequential import Placement, _listed, build_from_checkpoint
from ..model import OffloadModel
from ..loading.safetensors_files import SafetensorsCheckpoint
from .transformers_stages import CausalLMSequential, causal_lm_sequential

try:
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, GenerationConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        'offload.integrations.transformers_loading needs Hugging Face transformers 5: pip install "offload[transformers]"'
    ) from error

__all__ = ["load_causal_lm"]


def load_causal_lm(
    path: str | os.PathLike[str],
    device: torch.device | str | int,
    *,
    dtype: torch.dtype | str | None = None,
    loss_chunk_tokens: int | None = None,
    quantization_config: Any = None,
    attn_implementation: str | None = None,
    router_logits: bool | None = False,
    **options: Any,
) -> tuple[OffloadModel, nn.Module]:
    """Load a Hugging Face causal LM folder into an ``OffloadModel``, slice by slice.

    Equal to ``from_pretrained(path, dtype=dtype)``, then ``causal_lm_sequential`` and
    ``OffloadModel``: every parameter and buffer bit for bit, so logits, losses and gradients are
    too, and the generation config (the folder's ``generation_config.json``). But only the host
    copies are ever allocated, and the checkpoint is read tensor by tensor into them (Note:
    [Loading slice by slice] in ``offload/loading/sequential.py``): peak memory is what
    ``memory_footprint()`` reports afterwards plus one tensor when ``dtype`` differs from the
    checkpoint's, instead of the model twice or more.

    Args:
        path: a model folder: ``config.json`` and ``model.safetensors``, or a sharded checkpoint's
            ``model.safetensors.index.json`` and shards.
        device: the compute device, as for ``OffloadModel``.
        dtype: the dtype of the host copies (the masters): float32 by default (``None``), whatever the
            checkpoint stores; ``"auto"`` keeps the dtype ``config.json`` names, else the stored one.
            ``torch_dtype``, its old name, is taken where ``dtype`` is not given, with a
            ``FutureWarning``, as ``from_pretrained`` takes it.
        loss_chunk_tokens: as for ``causal_lm_sequential``.
        router_logits: as for ``causal_lm_sequential``.
        quantization_config: a ``transformers.BitsAndBytesConfig(load_in_4bit=True, ...)``: every
            linear layer but the head becomes a frozen bitsandbytes ``Linear4bit``, each weight
            quantised on the CPU as it is read, as ``from_pretrained(..., quantization_config=...,
            device_map="cpu")`` quantises it, bit for bit (Note: [Quantizing while loading] in
            ``offload/loading/four_bit.py``): the model is never in RAM unquantised.
        attn_implementation: as for ``from_pretrained`` (``"eager"``, ``"sdpa"``, ...): set on the
            config before the model is built, which checks it; the config's own by default.
        options: the other arguments of ``OffloadModel`` (``num_slices``, ``compute_dtype``,
            ``resident_slices``, ...),
            but ``process_group``.

    Returns:
        ``(model, hf_model)``: the ``OffloadModel`` and the Hugging Face model, in eval mode, whose
        modules the stages share (``hf_model.save_pretrained`` writes the trained weights).

    Raises:
        TypeError: a keyword argument that is neither one of the above nor ``OffloadModel``'s
            (``from_pretrained``'s ``device_map``, ``revision``, ...), in one line that lists them.
        ValueError: a checkpoint that does not match the model (missing or misshapen keys, each
            named with its file, and what to do), a checkpoint saved already quantized (its
            ``config.json`` has a ``quantization_config``), stored tensors that need a conversion
            other than stacking experts, a ``quantization_config`` other than bitsandbytes' 4 bits
            on the default skip list and storage, or what ``causal_lm_sequential`` refuses.
        FileNotFoundError: ``path`` is not a directory (checked before ``transformers`` is asked,
            which would take a missing folder for a Hub model's name), or it holds no safetensors
            checkpoint.
        ValueError: ``path`` is a :func:`~offload.save_checkpoint` directory (``offload.json``),
            which :func:`~offload.load_checkpoint` loads into a model built first.

    Example::

        model, hf = load_causal_lm("path/to/model", device="cuda", num_slices=8, compute_dtype=torch.bfloat16)
        optimizer = offload.OffloadOptimizer(model, torch.optim.AdamW, lr=1e-5)
    """
    dtype = _dtype_or_its_old_name(dtype, options)
    _refuse_unknown_options(options)
    path = _model_folder(path)
    config = AutoConfig.from_pretrained(path)
    _refuse_saved_quantized(path, config)
    if attn_implementation is not None:  # as from_pretrained sets it; the model checks it as it is built
        config._attn_implementation = attn_implementation
    checkpoint = SafetensorsCheckpoint(path)
    if dtype == "auto":
        dtype = _auto_dtype(config, checkpoint)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or 'auto', got {dtype!r}")
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    _read_generation_config(hf_model, path)
    # The stored names' targets, before a 4-bit layer's state_dict would read its meta state.
    meta_state = hf_model.state_dict()
    if quantization_config is not None:
        _quantize_on_meta(hf_model, quantization_config)
    hf_model.eval()
    layers = causal_lm_sequential(hf_model, loss_chunk_tokens=loss_chunk_tokens, router_logits=router_logits)
    unused: list[str] = []
    try:
        model = build_from_checkpoint(layers, checkpoint, device, init_buffers=_buffer_initialiser(hf_model),
                                      place=_placement(hf_model, layers, meta_state, unused), **options)
    except ValueError as error:
        advised = _advised(error, checkpoint, unused)
        if advised is None:
            raise
        raise advised from None
    _warn_unused(checkpoint, unused)
    _forget_untied(hf_model)
    model.eval()  # as its modules: built in train mode, as every nn.Module
    return model, hf_model


def _dtype_or_its_old_name(dtype: torch.dtype | str | None, options: dict[str, Any]) -> torch.dtype | str:
    """``dtype``, else ``torch_dtype`` taken out of ``options`` (warned of, as transformers' deprecated
    name: ``from_pretrained`` takes it where ``dtype`` is not given), else float32."""
    torch_dtype = options.pop("torch_dtype", None)
    if torch_dtype is not None:
        warnings.warn("torch_dtype is deprecated, as in transformers: use dtype instead", FutureWarning,
                      stacklevel=3)  # load_causal_lm's caller
    if dtype is None:
        dtype = torch_dtype
    return torch.float32 if dtype is None else dtype


def _read_generation_config(hf_model: nn.Module, folder: str) -> None:
    """Set the folder's generation config on ``hf_model`` as ``from_pretrained`` sets it
    (``adjust_generation_fn``): ``generation_config.json``, else one read from ``config.json``. The one
    ``from_config`` derived lacks the file's settings (an instruct model's several end tokens, its
    sampling defaults): generation would differ, and the next save would write it over the file."""
    if not hf_model.can_generate():
        return
    try:
        hf_model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json (or one that does not read): from_pretrained's fallback
        hf_model.generation_config = GenerationConfig.from_pretrained(folder, config_file_name="config.json",
                                                                       _from_model_config=True)


def _refuse_unknown_options(options: Mapping[str, Any]) -> None:
    """One line of refusal for keywords neither ``load_causal_lm``, ``build_from_checkpoint`` nor
    ``OffloadModel`` takes, before anything is read: ``OffloadModel`` would name only itself, a class
    the caller never called. (``process_group`` passes, to ``build_from_checkpoint``'s refusal,
    which says what to do.)"""
    offload_model = [name for name in inspect.signature(OffloadModel.__init__).parameters
                     if name not in ("self", "model", "device", "process_group")]
    unknown = sorted(set(options) - set(offload_model) - {"process_group", "untie_differing_copies"})
    if unknown:
        own = ["dtype", "loss_chunk_tokens", "quantization_config", "attn_implementation", "router_logits",
               "torch_dtype", "untie_differing_copies"]
        plural = "s" if len(unknown) > 1 else ""
        raise TypeError(f"load_causal_lm (and OffloadedCausalLM.from_pretrained) got unexpected keyword "
                        f"argument{plural}: {_listed([repr(k) for k in unknown])}; it takes {', '.join(own)} "
                        f"and OffloadModel's {', '.join(offload_model)}")


def _forget_untied(hf_model: nn.Module) -> None:
    """Drop from ``all_tied_weights_keys`` a pair the load left untied (its stored copies differ),
    as ``from_pretrained`` does: a later ``tie_weights()`` or ``init_weights()`` reads that mapping,
    and would tie again what the checkpoint holds apart."""
    tied = getattr(hf_model, "all_tied_weights_keys", None)
    if not isinstance(tied, dict):
        return
    parameters = dict(hf_model.named_parameters(remove_duplicate=False))
    hf_model.all_tied_weights_keys = {
        target: source for target, source in tied.items()
        if target not in parameters or source not in parameters or parameters[target] is parameters[source]}


def _model_folder(path: str | os.PathLike[str]) -> str:
    """``path`` with ``~`` expanded, once it is a folder that is not a :func:`save_checkpoint`
    directory; one line of refusal otherwise (``from_pretrained`` would look a missing folder up
    on the Hub, and call a checkpoint directory an unrecognized model)."""
    folder = os.path.expanduser(os.fspath(path))
    if not os.path.isdir(folder):
        what = "is a file" if os.path.exists(folder) else "does not exist"
        raise FileNotFoundError(f"load_causal_lm: {folder} {what}; pass a local model folder (config.json and "
                                "*.safetensors, as save_pretrained writes)")
    if os.path.isfile(os.path.join(folder, "offload.json")):
        raise ValueError(f"load_causal_lm: {folder} is a checkpoint of save_checkpoint(), not a model folder: build "
                         "the model as its run did (load_causal_lm of the model folder it started from, or "
                         "offload-finetune's options), then load_checkpoint(path, model, optimizer)")
    return folder


def _refuse_saved_quantized(path: str | os.PathLike[str], config: Any) -> None:
    """Refuse a checkpoint saved already quantized (``save_pretrained`` of a 4-bit or 8-bit model):
    its ``config.json`` names the quantisation, and its tensors are codes and their state, which
    the unquantized model built here has no place for (each would be reported unexpected)."""
    saved = getattr(config, "quantization_config", None)
    if not saved:  # absent, or an empty one (the parser's _saved_quantization reads it alike)
        return
    method = saved.get("quant_method") if isinstance(saved, dict) else getattr(saved, "quant_method", None)
    method = getattr(method, "value", method) or "a quantisation"
    raise ValueError(
        f"{path} holds a checkpoint saved quantized ({method}: its config.json has a quantization_config), which "
        "load_causal_lm cannot read: load the unquantized checkpoint it was made from, with quantization_config="
        "BitsAndBytesConfig(load_in_4bit=True, ...) to quantise it as it is read, or load this one with "
        "from_pretrained(path, device_map=\"cpu\") and wrap it with causal_lm_sequential and OffloadModel"
    )


def _named(quantization_config: Any) -> str:
    """A quantisation config in a few words: its repr is the whole config, dozens of lines."""
    if isinstance(quantization_config, BitsAndBytesConfig):
        return "a BitsAndBytesConfig(load_in_8bit=True)" if quantization_config.load_in_8bit else \
            "a BitsAndBytesConfig without load_in_4bit"
    return f"a {type(quantization_config).__name__}"


def _quantize_on_meta(hf_model: nn.Module, quantization_config: Any) -> None:
    """Make the meta model's linear layers 4-bit ones of the shapes a real quantisation gives, and
    mark the model as ``from_pretrained`` marks a 4-bit one (PEFT reads the marks)."""
    if not isinstance(quantization_config, BitsAndBytesConfig) or not quantization_config.load_in_4bit:
        raise ValueError(f"quantization_config must be a BitsAndBytesConfig(load_in_4bit=True, ...), got "
                         f"{_named(quantization_config)}; load other quantisations with from_pretrained and wrap the model")
    if quantization_config.llm_int8_skip_modules is not None or quantization_config.bnb_4bit_quant_storage != torch.uint8:
        raise ValueError("load_causal_lm quantises every linear layer but the head, into uint8 storage: leave "
                         "llm_int8_skip_modules and bnb_4bit_quant_storage unset, or load with from_pretrained")
    import bitsandbytes

    quantize_linears(hf_model, bitsandbytes, quant_type=quantization_config.bnb_4bit_quant_type,
                     double_quant=quantization_config.bnb_4bit_use_double_quant,
                     compute_dtype=quantization_config.bnb_4bit_compute_dtype or torch.float32, device="meta")
    hf_model.config.quantization_config = quantization_config
    hf_model.is_loaded_in_4bit = True
    hf_model.quantization_method = "bitsandbytes"


def _auto_dtype(config: Any, checkpoint: SafetensorsCheckpoint) -> torch.dtype:
    # As from_pretrained(dtype="auto"): the config's dtype, else the stored floating-point tensors'.
    named = getattr(config, "dtype", None)
    if isinstance(named, str):
        named = getattr(torch, named, None)
    if isinstance(named, torch.dtype):
        return named
    stored = [t.dtype for t in checkpoint.tensors.values() if t.dtype.is_floating_point]
    return stored[0] if stored else torch.get_default_dtype()


def _buffer_initialiser(hf_model: nn.Module) -> Callable[[nn.Module], None]:
    def init_buffers(module: nn.Module) -> None:
        # _init_weights sets a module's parameters too; transformers' init functions skip tensors
        # flagged as initialised, which the parameters are about to be (from the checkpoint).
        unflagged = [p for p in module.parameters(recurse=False) if not getattr(p, "_is_hf_initialized", False)]
        for param in unflagged:
            param._is_hf_initialized = True
        try:
            hf_model._init_weights(module)
        finally:
            for param in unflagged:
                del param._is_hf_initialized

    return init_buffers


def _placement(hf_model: nn.Module, layers: CausalLMSequential, meta_state: dict[str, torch.Tensor],
               unused: list[str] | None = None) -> Callable[[str], Placement | None]:
    """Where each stored name goes: through the model's renamings and converters to its Hugging
    Face key, then to the stages' key; ``None`` (skipped, never read) for a name that names
    nothing, which is appended to ``unused`` unless ``from_pretrained`` drops it silently."""
    to_stage = {layers.hf_name(key): key for key, _ in (*layers.named_parameters(remove_duplicate=False),
                                                         *layers.named_buffers(remove_duplicate=False))}
    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    ignored = _ignored_unexpected(hf_model)

    def place(stored_name: str) -> Placement | None:
        name, pattern = rename_source_key(stored_name, renamings, converters, hf_model.base_model_prefix, meta_state)
        key = to_stage.get(name)
        if key is None:
            # Names nothing: from_pretrained drops it, with a report unless the patterns say not to
            # (applied, as there, only to such keys: they match real names too).
            if unused is not None and not any(p.search(name) for p in ignored):
                unused.append(stored_name)
            return None
        if pattern is None:
            return Placement(key)
        converter = next(c for c in converters if pattern in c.source_patterns)
        return Placement(key, _expert_part(converter, pattern, stored_name))

    return place


def _ignored_unexpected(hf_model: nn.Module) -> list[re.Pattern[str]]:
    """The stored names ``from_pretrained`` drops without a word (``_adjust_missing_and_unexpected_keys``
    in transformers' ``modeling_utils.py``): those the model lists in ``_keys_to_ignore_on_load_unexpected``,
    and two kinds older transformers saved, where the model has the buffer they became: each
    layer's rotary ``inv_freq`` (now one, non-persistent, for the model) and ``position_ids`` (now
    non-persistent)."""
    patterns = set(getattr(hf_model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in hf_model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return [re.compile(pattern) for pattern in sorted(patterns)]


def _warn_unused(checkpoint: SafetensorsCheckpoint, unused: list[str]) -> None:
    """One warning for the stored tensors that name nothing in the model and were skipped, as
    ``from_pretrained`` reports them (its "UNEXPECTED" keys) and loads the rest."""
    if not unused:
        return
    warnings.warn(f"the checkpoint at {checkpoint.path} stores tensors that name nothing in the model, which were "
                  f"not read, as from_pretrained leaves them unused: {_with_files(checkpoint, unused)}. Harmless for "
                  "buffers older transformers saved (GPT-2's attn.masked_bias); for weights, check that config.json "
                  "is the one saved with them", stacklevel=3)  # load_causal_lm's caller


def _advised(error: ValueError, checkpoint: SafetensorsCheckpoint, unused: list[str]) -> ValueError | None:
    """``error`` told with what to do, where it is a checkpoint that does not match the model (keys
    missing, shapes that differ), else ``None``; the stored tensors that name nothing are told with
    it, as they often explain it (a checkpoint of another architecture, or of other names)."""
    if not str(error).startswith(f"the checkpoint at {checkpoint.path} does not match the model"):
        return None
    stored = f"; stored but naming nothing in the model: {_with_files(checkpoint, unused)}" if unused else ""
    return ValueError(f"{error}{stored}. load_causal_lm reads every parameter and persistent buffer from the "
                      "checkpoint: check that config.json is the one saved with these weights and that the folder "
                      "holds every shard. To train tensors the checkpoint lacks from a fresh initialisation, or of "
                      "other shapes (ignore_mismatched_sizes=True), load with from_pretrained, which initialises "
                      "them, and wrap the model with causal_lm_sequential and OffloadModel")


def _with_files(checkpoint: SafetensorsCheckpoint, names: list[str]) -> str:
    return _listed([f"'{name}' ({checkpoint[name].file.name})" for name in names])


class _ConvertedOnLoading(ValueError):
    """A stored tensor in a form the model converts on loading other than experts one by one (Sarvam-MoE's
    fused ``query_key_value``, split into the three projections): told for ``load_causal_lm``, which
    ``OffloadedCausalLM.from_pretrained`` and ``offload-finetune --model`` call; ``load_state_dict``
    words it for itself (:func:`stored_into_stages`)."""

    def __init__(self, stored_name: str, converter: WeightConverter) -> None:
        self.stored_name, self.converter = stored_name, converter
        super().__init__(
            f"'{stored_name}' is stored in a form the model converts on loading ({converter!r}); load_causal_lm (and "
            "so OffloadedCausalLM.from_pretrained and offload-finetune --model) reads only experts stored one by one "
            "in place. Load this checkpoint with transformers' from_pretrained and wrap that model with "
            "OffloadedCausalLM(hf_model, ...) or causal_lm_sequential instead")


def split_on_loading(hf_model: nn.Module) -> list[str]:
    """The stored names (patterns) that ``hf_model``'s conversions split into several of its tensors on
    loading, which :func:`load_causal_lm` does not read (Sarvam-MoE's ``query_key_value``): every
    checkpoint of such a model stores them, so ``offload plan`` prints no ``offload-finetune`` for it."""
    return [pattern for transform in get_model_conversion_mapping(hf_model)
            if isinstance(transform, WeightConverter) and len(transform.target_patterns) > 1
            for pattern in transform.source_patterns]


def _expert_part(converter: WeightConverter, pattern: str, stored_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The view of the stacked tensor that one expert's stored tensor fills, for the conversions
    that stack experts (``MergeModulelist(dim=0)``) and join the parts of each (``Concatenate(dim=1)``)."""
    ops = converter.operations
    stacks = (isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
              and (len(ops) == 1 or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1)))
    found = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), stored_name)
    if not stacks or found is None:
        raise _ConvertedOnLoading(stored_name, converter)
    expert = int(found.group(1))
    parts = len(converter.source_patterns)
    part = converter.source_patterns.index(pattern)

    def region(stacked: torch.Tensor) -> torch.Tensor:
        rows = stacked.shape[1] // parts
        return stacked[expert].narrow(0, part * rows, rows)

    return region


def stored_into_stages(hf_model: nn.Module, layers: CausalLMSequential, stored: Mapping[str, torch.Tensor],
                       given: set[str], prefix: str = "") -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """The stages' tensors that ``stored`` (tensors under their stored names, as ``save_pretrained``
    writes them) make, converted as ``from_pretrained`` converts them: renamed, and experts stored
    one by one stacked into place (:func:`_placement`, as :func:`load_causal_lm` reads them).

    A stored name that names no tensor of the stages, or one in ``given`` (the stage keys the state
    dict holds already, in the model's own names), is left out: the caller reports it unexpected.
    So are the parts of a stacked tensor that do not fill it exactly once (an expert missing), and
    that tensor is then missing. The parts of one stacked tensor must all be in ``stored``
    (:func:`~offload.integrations.transformers_saving.save_causal_lm` writes a layer's in one shard).

    Args:
        prefix: the stored names' prefix in the caller's state dict, for the error messages.

    Returns:
        ``(tensors, used, errors)``: the tensors by stage key; the stored names they were made
        from; and, in ``load_state_dict``'s words, the stored tensors whose shape does not fit
        their place, or that are stored in a form other than experts one by one.
    """
    place = _placement(hf_model, layers, hf_model.state_dict())
    targets = dict(layers.named_parameters(remove_duplicate=False))
    targets.update(layers.named_buffers(remove_duplicate=False))
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, list[tuple[str, Placement]]] = {}
    used: list[str] = []
    errors: list[str] = []
    for name in stored:
        try:
            placement = place(name)
        except ValueError as error:  # a conversion other than stacking experts
            errors.append(str(error) if not isinstance(error, _ConvertedOnLoading) else
                          f"'{prefix}{name}' is stored in a form the model converts on loading ({error.converter!r}), "
                          "which load_state_dict does not convert (it stacks experts stored one by one, and takes "
                          "the model's own names): load these tensors' folder with transformers' from_pretrained "
                          "and pass that model's state_dict()")
            continue
        if placement is None or placement.key not in targets or placement.key in given or placement.key in tensors:
            continue
        if placement.part is None:
            tensors[placement.key] = stored[name]
            used.append(name)
        else:
            parts.setdefault(placement.key, []).append((name, placement))
    for key, sources in parts.items():
        stacked = _stacked(targets[key], sources, stored, errors, prefix)
        if stacked is not None:
            tensors[key] = stacked
            used.extend(name for name, _ in sources)
    return tensors, used, errors


def _stacked(target: torch.Tensor, sources: list[tuple[str, Placement]], stored: Mapping[str, torch.Tensor],
             errors: list[str], prefix: str) -> torch.Tensor | None:
    """A tensor shaped as ``target``, in the stored dtype, filled from the parts in ``sources``; ``None``
    where they do not fill it exactly once, or (told in ``errors``) one does not fit its place."""
    shape = torch.empty(target.shape, device="meta")
    offsets: set[int] = set()
    for name, placement in sources:
        try:
            region = placement.region(shape)
        except (IndexError, RuntimeError):  # an expert too many
            region = None
        if region is None or region.shape != stored[name].shape:
            errors.append(f"size mismatch for {prefix}{name}: copying a param with shape {tuple(stored[name].shape)} from "
                          f"checkpoint, its part of the model's tensor is "
                          f"{'outside it' if region is None else tuple(region.shape)}")
            return None
        offsets.add(region.storage_offset())
    covered = sum(placement.region(shape).numel() for _, placement in sources)
    if len(offsets) != len(sources) or covered != shape.numel():
        return None  # a part twice, or one missing: the stored parts stay unexpected, the tensor missing
    first = stored[sources[0][0]]
    stacked = torch.empty(target.shape, dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for name, placement in sources:
            placement.region(stacked).copy_(stored[name])
    return stacked
