"""``parallel_clipping``: Hugging Face's ``Trainer`` (and TRL's trainers, and an Accelerate loop)
clip an offloaded model's host gradients with :func:`offload.clip_grad_norm_`.

The ``Trainer`` clips, and logs the gradients' norm, through ``accelerator.clip_grad_norm_``, which
on one process (or under DDP) unscales the gradients and calls ``torch.nn.utils.clip_grad_norm_``:
one thread reads every host gradient for its norm (Note: [Norms on several threads] in
``offload/clipping.py``). No hook of the ``Trainer`` reaches that call, so this replaces the
accelerator's method on the one instance: the same unscaling, then ``offload.clip_grad_norm_``,
the same result bit for bit. Where the accelerator clips in its own way (FSDP, DeepSpeed, XLA,
gradients that are ``DTensor``s), its method runs unchanged.
"""

from __future__ import annotations

from typing import Any

from ..clipping import clip_grad_norm_

__all__ = ["parallel_clipping"]

#: Accelerate's distributed types whose ``clip_grad_norm_`` is PyTorch's over plain gradients.
_PLAIN = ("NO", "MULTI_CPU", "MULTI_GPU")


def parallel_clipping(trainer: Any) -> Any:
    """Make ``trainer`` (a ``transformers.Trainer``, a TRL trainer, or an ``accelerate.Accelerator``)
    clip with :func:`offload.clip_grad_norm_`; returns ``trainer``.

    Example::

        >>> trainer = parallel_clipping(transformers.Trainer(model=model, args=args, ...))

    Raises:
        TypeError: ``trainer`` has no accelerator (nor is one).
    """
    accelerator = getattr(trainer, "accelerator", trainer)
    original = getattr(accelerator, "clip_grad_norm_", None)
    if original is None or not hasattr(accelerator, "unscale_gradients"):
        raise TypeError(f"parallel_clipping takes a transformers.Trainer or an accelerate.Accelerator, "
                        f"got {type(trainer).__name__}")
    if getattr(original, "offload_parallel", False):
        return trainer

    def parallel_clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        parameters = list(parameters)
        if getattr(accelerator.distributed_type, "name", None) not in _PLAIN or any(
                _is_dtensor(p.grad) for p in parameters):
            return original(parameters, max_norm, norm_type)
        accelerator.unscale_gradients()  # what Accelerate does first: GradScaler's unscale_, once a step
        return clip_grad_norm_(parameters, max_norm, norm_type)

    parallel_clip_grad_norm_.offload_parallel = True  # type: ignore[attr-defined]
    accelerator.clip_grad_norm_ = parallel_clip_grad_norm_
    return trainer


def _is_dtensor(tensor: Any) -> bool:
    if tensor is None:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a PyTorch built without distributed
        return False
    return isinstance(tensor, DTensor)
