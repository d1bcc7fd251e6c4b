"""The 4-D attention masks of a causal LM's decoder stages, built once per run of a slice rather than
once per layer (:class:`_MaskCache`).

It holds the cache only; which mask function a layer gets is decided where the stages are cut
(``transformers_stages.py``), and the layers call it through the cache (``transformers_layers.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


class _MaskCache:
    """The 4-D masks of the decoder stages, built once per run of a slice rather than once per layer.

    The plain model builds each kind of mask once per forward and hands it to every layer. Building
    one costs more than its arithmetic: the mask functions look at mask and position values from
    the host (is there padding? are sequences packed?), which on a GPU waits for the device to
    catch up, once per call. The stages of one slice receive the same ``attention_mask`` and
    ``position_ids`` objects, so the mask built for them is reused while they are the ones coming
    in; a new slice, microbatch or recompute gets new ones. One mask per kind is kept, dropped when
    either tensor is freed; the key includes their versions (a mask changed in place is seen) and
    the attention implementation the mask is built for. Anything else (inference tensors, which
    have no version; a flex-attention ``BlockMask``) is not cached.
    """

    def __init__(self) -> None:
        self._masks: dict[Callable[..., Any], tuple[tuple[Any, ...], Any]] = {}
        self._watched: set[tuple[Callable[..., Any], int]] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"_masks": {}, "_watched": set()}  # masks of a run in progress are not part of the model

    def clear(self) -> None:
        self._masks.clear()

    def build(self, function: Callable[..., Any], config: Any, hidden: torch.Tensor,
              attention_mask: Any, position_ids: Any) -> Any:
        def call() -> Any:
            # The (absent) cache goes by position: transformers 5.24 renamed the keyword from
            # ``past_key_values`` to ``cache`` and warns on the old name, 5.20 knows only the old one.
            return function(config, hidden, attention_mask, None, position_ids=position_ids)

        keyed = [t for t in (position_ids, attention_mask) if t is not None]
        if not keyed or not all(type(t) is torch.Tensor and not t.is_inference() for t in keyed):
            return call()
        key = (hidden.shape, hidden.dtype, hidden.device, getattr(config, "_attn_implementation", None),
               *((id(t), t._version) for t in keyed))
        entry = self._masks.get(function)
        if entry is not None and entry[0] == key:
            return entry[1]
        mask = call()
        self._masks[function] = (key, mask)
        for tensor in keyed:
            # Forget the mask when the tensor is freed: its id may then be reused by another tensor.
            if (function, id(tensor)) not in self._watched:
                self._watched.add((function, id(tensor)))
                weakref.finalize(tensor, self._forget, function, id(tensor))
        return mask

    def _forget(self, function: Callable[..., Any], tensor_id: int) -> None:
        self._watched.discard((function, tensor_id))
        entry = self._masks.get(function)
        if entry is not None and any(part[0] == tensor_id for part in entry[0][4:]):
            del self._masks[function]
