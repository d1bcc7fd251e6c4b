"""A Hugging Face causal LM trained in an :class:`~offload.OffloadModel` written as ``save_pretrained`` would, one slice at a time.

:func:`save_causal_lm` writes one safetensors shard per slice and, with masters on disk
(``OffloadModel(..., masters=DiskTier(...))``), takes each slice's masters out of RAM once its
shard is written: ``hf.save_pretrained`` reads every master into RAM before it is done, which
peaks higher than training does (Note: [Masters on disk] in ``offload/tiers/master_files.py``). The
folder loads with ``from_pretrained`` and ``load_causal_lm`` as ``save_pretrained``'s does (and, where
``load_causal_lm`` refuses that one, as a Sarvam-MoE's fused ``query_key_value``, this one too). It
does not save adapters (``PeftModel.save_pretrained`` writes only those, which are small) or a
tokenizer.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..model import OffloadModel, engine_of

try:
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import _get_tied_weight_keys
except ImportError as error:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        'offload.integrations.transformers_saving needs Hugging Face transformers 5: pip install "offload[transformers]"'
    ) from error

__all__ = ["save_causal_lm", "save_options"]

INDEX_NAME = "model.safetensors.index.json"
#: A shard's working name until the last one is written (its final name says how many there are).
PARTIAL_STEM = "model.safetensors.partial-"

#: ``save_pretrained``'s keywords and the values at which they change nothing here.
_DEFAULTS = {"is_main_process": True, "state_dict": None, "push_to_hub": False, "max_shard_size": None,
             "variant": None, "token": None, "save_peft_format": True, "save_original_format": True,
             "distributed_checkpoint": False, "safe_serialization": True}


def positional_save_arguments(args: tuple[Any, ...], is_main_process: bool, state_dict: Any
                              ) -> tuple[tuple[Any, ...], bool, Any]:
    """``save_pretrained``'s first two positional arguments after the folder, as its own signature
    takes them (``is_main_process``, ``state_dict``), and the positional arguments after them."""
    named = dict(zip(("is_main_process", "state_dict"), args))
    return args[2:], named.get("is_main_process", is_main_process), named.get("state_dict", state_dict)


def save_options(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``PreTrainedModel.save_pretrained`` (after the folder) that
    :func:`save_causal_lm` honours, ``max_shard_size`` and ``variant``, as its keywords.

    Raises:
        TypeError: any other argument at a value that would change what ``save_pretrained`` does
            (``push_to_hub``, ``token``, ``distributed_checkpoint``, ``save_original_format=False``,
            ``safe_serialization=False``, ...): it would otherwise be dropped without a word.
    """
    names = list(_DEFAULTS)[2:][:len(args)]  # save_pretrained's positional order, after state_dict
    given = {**dict(zip(names, args)), **kwargs}
    honoured = {key: given.pop(key) for key in ("max_shard_size", "variant") if key in given}
    refused = sorted(key for key, value in given.items() if key not in _DEFAULTS or value != _DEFAULTS[key])
    if refused:
        push = " To publish the folder, save it and call huggingface_hub.upload_folder(repo_id=..., folder_path=...)."
        raise TypeError(
            f"OffloadedCausalLM.save_pretrained writes the folder slice by slice, in safetensors, with max_shard_size "
            f"and variant; it cannot honour {', '.join(refused)}.{push if 'push_to_hub' in given else ''}")
    return honoured


def save_causal_lm(model: OffloadModel, hf_model: nn.Module, path: str | os.PathLike[str], *,
                   max_shard_size: int | str | None = None, variant: str | None = None) -> list[Path]:
    """Write ``hf_model``'s weights, config and generation config into ``path``, a slice at a time.

    The result is what ``hf_model.save_pretrained(path)`` writes but for the shards: one
    ``model-0000i-of-0000n.safetensors`` per slice of ``model`` (with its index), or one
    ``model.safetensors`` when there is one slice; a slice larger than ``max_shard_size`` is
    written in several. The config's ``dtype`` is the dtype of the weights written. Tied weights are written once and stored names
    go through the model's conversion mapping back, as ``save_pretrained`` does. Call
    ``optimizer.synchronize()`` first when an update may be pending.

    Memory: with masters on disk, about one slice's masters and one shard's serialised bytes at a
    time, instead of every master.

    Args:
        model: the ``OffloadModel`` wrapping ``causal_lm_sequential(hf_model)``.
        hf_model: the Hugging Face model whose modules it shares.
        path: the output directory; made if missing.
        max_shard_size: at most this many bytes a shard (``"5GB"`` or an int), as for ``save_pretrained``.
        variant: written into the file names (``model.fp16.safetensors``), as for ``save_pretrained``.

    Returns:
        The weight files written, in slice order.

    Example::

        >>> optimizer.synchronize()
        >>> save_causal_lm(model, hf, "tuned")       # AutoModelForCausalLM.from_pretrained("tuned")
    """
    limit = size_in_bytes(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size  # before any write
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for left in out.glob(f"{PARTIAL_STEM}*"):  # shards a failed save left under their working names
        left.unlink()
    engine = engine_of(model)
    state = _without_aliases(hf_model.state_dict(), hf_model)
    # Each tensor goes with the slice whose host buffer holds it; anything not held by a slice
    # (none in the supported families) is written after the last one. The stored names and
    # layouts are restored per slice: a conversion (stacked experts written one by one) makes
    # new tensors, which should exist for one slice at a time; its inputs are one layer's, and a
    # slice holds whole layers.
    owner = {entry.tensor.untyped_storage().data_ptr(): s.index
             for s in engine.slices for entry in s.storage.held}
    groups: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        index = owner.get(tensor.untyped_storage().data_ptr(), engine.num_slices)
        groups.setdefault(index, {})[name] = tensor
    # A shard's name says how many there are, known once the last slice is cut (by max_shard_size):
    # each is written under a name of its own first, renamed at the end.
    written: list[tuple[Path, list[str], int]] = []  # (file so far, its keys, its bytes)
    for index in sorted(groups):
        for part in _shards(revert_weight_conversion(hf_model, groups.pop(index)), limit):
            shard = {key: tensor.contiguous() for key, tensor in part.items()}
            partial = out / f"{PARTIAL_STEM}{len(written) + 1:05d}"
            save_file(shard, partial, metadata={"format": "pt"})
            written.append((partial, list(shard), sum(t.numel() * t.element_size() for t in shard.values())))
            del shard, part
        if index < engine.num_slices:
            engine.release_masters(index)  # its pages are in the file now (Note: [Masters on disk])
    return _name_shards(out, written, hf_model, variant)


def _shards(stored: dict[str, torch.Tensor], limit: int | None) -> list[dict[str, torch.Tensor]]:
    """One slice's tensors in shards of at most ``limit`` bytes each (a larger tensor alone), in
    order, as ``save_pretrained`` fills its shards; all in one without a limit."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in stored.items():
        nbytes = tensor.numel() * tensor.element_size()
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def _name_shards(out: Path, written: list[tuple[Path, list[str], int]], hf_model: nn.Module,
                 variant: str | None) -> list[Path]:
    """Give the shards their ``save_pretrained`` names (``variant`` in them), write the index, the
    config (the dtype the weights were written in, as ``save_pretrained`` sets it) and the
    generation config."""
    stem = "model" if variant is None else f"model.{variant}"
    names = ([f"{stem}.safetensors"] if len(written) == 1 else
             [f"{stem}-{k + 1:05d}-of-{len(written):05d}.safetensors" for k in range(len(written))])
    index_name = INDEX_NAME if variant is None else INDEX_NAME.replace(".json", f".{variant}.json")
    _remove_old_weights(out, stem, index_name, keep=set(names))
    for (partial, _, _), name in zip(written, names):
        partial.replace(out / name)
    if len(names) > 1:
        weight_map = {key: name for (_, keys, _), name in zip(written, names) for key in keys}
        index_file = {"metadata": {"total_size": sum(size for _, _, size in written)},
                      "weight_map": dict(sorted(weight_map.items()))}
        (out / index_name).write_text(json.dumps(index_file, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    hf_model.config.dtype = str(hf_model.dtype).split(".")[1]  # the first floating parameter's, as save_pretrained
    hf_model.config.architectures = [type(hf_model).__name__]
    hf_model.config.save_pretrained(out)
    if hf_model.can_generate() and getattr(hf_model, "generation_config", None) is not None:
        hf_model.generation_config.save_pretrained(out)
    return [out / name for name in names]


def _without_aliases(state: dict[str, torch.Tensor], hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """``state`` with each tied weight once, under the name ``from_pretrained`` ties the others to.

    Note: [Aliases, not shared storage]
        ``save_pretrained`` (``remove_tied_weights_from_state_dict``) clones every tensor that
        shares storage with another without being the same view, so that safetensors takes them:
        here every host copy of a slice is a view of one flat buffer, so it would clone the whole
        model, the masters on disk read into RAM with it. Only true aliases (the same view: a tied
        embedding) are dropped here, and the shards are written from the views themselves.
    """
    patterns = set(_get_tied_weight_keys(hf_model))
    groups: dict[tuple[object, ...], list[str]] = {}
    for name, tensor in state.items():
        view = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        groups.setdefault(view, []).append(name)
    dropped: set[str] = set()
    for names in groups.values():
        if len(names) > 1:
            # Keep the name that is not declared tied to another (the one the others are tied to).
            keep = next((n for n in names if not any(re.search(p, n) for p in patterns)), names[0])
            dropped.update(n for n in names if n != keep)
    return {name: tensor for name, tensor in state.items() if name not in dropped}


def _remove_old_weights(out: Path, stem: str, index_name: str, keep: set[str]) -> None:
    """A previous save's weight files (of this variant) that this one does not replace would be read with it."""
    shard = re.compile(rf"{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.safetensors")
    for file in out.iterdir():
        if file.name not in keep and file.is_file() and (file.name == index_name or shard.fullmatch(file.name)):
            file.unlink()


#: The units ``save_pretrained``'s ``max_shard_size`` takes, as Hugging Face reads them.
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size_in_bytes(size: str) -> int:
    """``max_shard_size`` given as a string (``"5GB"``, ``"500MB"``, ``"2GiB"``), in bytes.

    Raises:
        ValueError: not a number followed by one of the units above.
    """
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]+)\s*", size)
    unit = match[2].upper() if match else ""
    try:
        if unit not in _SIZE_UNITS:
            raise ValueError
        return int(float(match[1]) * _SIZE_UNITS[unit])  # type: ignore[index]
    except ValueError:
        raise ValueError(f"max_shard_size must be a byte count or a number followed by KB, MB, GB, TB, KiB, MiB, "
                         f"GiB or TiB (\"5GB\"), got {size!r}") from None
