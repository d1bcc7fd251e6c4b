"""A Hugging Face causal LM trained in an :class:`~offload.OffloadModel` written as ``save_pretrained`` would, one slice at a time.

:func:`save_causal_lm` writes one safetensors shard per slice and, with masters on disk
(``OffloadModel(..., masters=DiskTier(...))``), takes each slice's masters out of RAM once its
shard is written: ``hf.save_pretrained`` reads every master into RAM before it is done, which
peaks higher than training does (Note: [Masters on disk] in ``offload/tiers/master_files.py``). The
folder loads with ``from_pretrained`` and ``load_causal_lm`` as ``save_pretrained``'s does. It
does not save adapters (``PeftModel.save_pretrained`` writes only those, which are small) or a
tokenizer.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

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

__all__ = ["save_causal_lm"]

INDEX_NAME = "model.safetensors.index.json"


def save_causal_lm(model: OffloadModel, hf_model: nn.Module, path: str | os.PathLike[str]) -> list[Path]:
    """Write ``hf_model``'s weights, config and generation config into ``path``, a slice at a time.

    The result is what ``hf_model.save_pretrained(path)`` writes but for the shards: one
    ``model-0000i-of-0000n.safetensors`` per slice of ``model`` (with its index), or one
    ``model.safetensors`` when there is one slice. Tied weights are written once and stored names
    go through the model's conversion mapping back, as ``save_pretrained`` does. Call
    ``optimizer.synchronize()`` first when an update may be pending.

    Memory: with masters on disk, about one slice's masters and one shard's serialised bytes at a
    time, instead of every master.

    Args:
        model: the ``OffloadModel`` wrapping ``causal_lm_sequential(hf_model)``.
        hf_model: the Hugging Face model whose modules it shares.
        path: the output directory; made if missing.

    Returns:
        The weight files written, in slice order.

    Example::

        >>> optimizer.synchronize()
        >>> save_causal_lm(model, hf, "tuned")       # AutoModelForCausalLM.from_pretrained("tuned")
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
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
    order = sorted(groups)
    names = (["model.safetensors"] if len(order) == 1 else
             [f"model-{k + 1:05d}-of-{len(order):05d}.safetensors" for k in range(len(order))])
    _remove_old_weights(out, keep=set(names))
    weight_map: dict[str, str] = {}
    total = 0
    for index, name in zip(order, names):
        stored = revert_weight_conversion(hf_model, groups.pop(index))
        shard = {key: tensor.contiguous() for key, tensor in stored.items()}
        save_file(shard, out / name, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(shard, name))
        del shard
        if index < engine.num_slices:
            engine.release_masters(index)  # its pages are in the file now (Note: [Masters on disk])
    if len(names) > 1:
        index_file = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_NAME).write_text(json.dumps(index_file, indent=2, sort_keys=True) + "\n", encoding="utf-8")
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


def _remove_old_weights(out: Path, keep: set[str]) -> None:
    """A previous save's weight files that this one does not replace would be read with it."""
    for file in out.iterdir():
        if file.name not in keep and file.is_file() and (
                file.name == INDEX_NAME or (file.name.startswith("model") and file.suffix == ".safetensors")):
            file.unlink()
