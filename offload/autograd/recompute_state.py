"""Whether the slice running now is a recompute: backward re-running a slice's forward.

A forward (pre-)hook on a layer fires again when backward recomputes the layer's slice, as with
``torch.utils.checkpoint``: twice per step for layers in a recomputed slice, once in the last slice
(its graph is kept from forward) and once everywhere with ``checkpoint_activation=False``. A hook
that records activations, or counts calls, asks :func:`offload.is_recomputing` to tell them apart.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_state = threading.local()


def is_recomputing() -> bool:
    """Whether the calling code runs inside a slice's recompute during backward.

    Example::

        >>> def record(module, inputs, output):
        ...     if not offload.is_recomputing():
        ...         activations.append(output.detach())
        >>> layer.register_forward_hook(record)
    """
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
