"""Whether the slice running now is a recompute (backward re-running a slice's forward), or a
forward whose graph backward will not use (the slice will be recomputed).

A forward (pre-)hook on a layer fires again when backward recomputes the layer's slice, as with
``torch.utils.checkpoint``: twice per step for layers in a recomputed slice, once in the last slice
(its graph is kept from forward) and once everywhere with ``checkpoint_activation=False``. A hook
that records activations, or counts calls, asks :func:`offload.is_recomputing` to tell them apart.

Gradients flow through the recompute's graph, not through the forward's, which keeps nothing: a
``retain_grad()`` or a tensor hook on a forward's activation of a recomputed slice never receives
a gradient. A hook that reads an activation's gradient registers it where
:func:`offload.will_recompute` is ``False``: in the recompute, or in a forward whose graph is kept.
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


def will_recompute() -> bool:
    """Whether the calling code runs in a slice's forward whose graph backward will not use: the
    slice keeps no activations and runs again in backward (``checkpoint_activation=True``, the
    default, for every slice but the last). A ``retain_grad()`` or a tensor hook on an activation
    made there never receives a gradient; made where this is ``False`` (the recompute, or a forward
    whose graph is kept), it does, as in the plain model.

    Example::

        >>> def keep_gradient(module, inputs, output):   # Grad-CAM: the gradient of a layer's output
        ...     if not offload.will_recompute():
        ...         output.register_hook(gradients.append)
        >>> layer.register_forward_hook(keep_gradient)
    """
    return getattr(_state, "discarded", 0) > 0


@contextlib.contextmanager
def _inside(depth: str) -> Iterator[None]:
    """Count one more level of ``depth`` on this thread while the block runs (nested walks nest)."""
    setattr(_state, depth, getattr(_state, depth, 0) + 1)
    try:
        yield
    finally:
        setattr(_state, depth, getattr(_state, depth) - 1)


def discarded_graph() -> contextlib.AbstractContextManager[None]:
    """Around a slice's forward whose graph keeps nothing (see :func:`will_recompute`)."""
    return _inside("discarded")


def recomputing() -> contextlib.AbstractContextManager[None]:
    """Around a slice's recompute in backward (see :func:`is_recomputing`)."""
    return _inside("depth")
