"""Per-slice milestones of a walk, for concerns that are not autograd's.

The forward and backward walks announce what happened to each slice (``offload/autograd/function.py``
and, for gradients, ``offload/autograd/gradients.py``); gradient reduction across processes, and
anything else that has to act slice by slice, subscribes here instead of being written into the
walks. A *token* identifies one forward and its backward (several may be in flight).

- ``forward_started(token)``: a forward with autograd begins.
- ``gradients_produced(token, index, grads)``: slice ``index``'s gradients are complete on the
  device (``grads.device_tensors()``), summed over microbatches, about to leave for the host.
- ``gradients_leaving(token, index, pending)``: slice ``index``'s gradients are on their way to
  the host (``pending.ready`` completes when they are there); backward goes on with the slices
  before it.
- ``gradients_landed(token, pending)``: every slice's gradients are on the host, per slice
  index; backward returns them to autograd right after the subscribers return.
- ``backward_started(token, accumulates)``: a backward of ``token``'s forward begins;
  ``accumulates``: it adds the model's gradients into ``.grad`` (``.backward()``, not
  ``torch.autograd.grad``).
- ``wants_final_gradients(token)``: whether a subscriber reads each slice's gradients as ``.grad``
  will hold them at the end of this backward (``gradients_final``); asked once, after
  ``backward_started``. Backward then adds into ``.grad`` on landing wherever it may
  (Note: [Gradients added in place], widened by Note: [Update in backward]).
- ``final_parameters(token)``: the ids of the parameters whose final gradients a subscriber reads
  (the others keep rule 6 of Note: [Gradients added in place]); asked with ``wants_final_gradients``.
- ``gradients_final(token, index, grads, ready)``: slice ``index``'s gradients, per parameter,
  as ``.grad`` will hold them when backward returns (``None``: this backward leaves ``.grad`` as
  it is), valid on the host once ``ready`` has completed. Outside ``final_parameters``, a
  parameter whose existing ``.grad`` backward does not add into itself gets what autograd adds
  onto it after backward, not the sum (the norms of Note: [Norms from backward] skip those).

A subscriber that rewrites the host gradients on their way (data parallelism's average) says so
with ``rewrites_gradients``: backward then leaves every gradient to autograd (rule 5 of Note:
[Gradients added in place]).

Loading a slice waits for its pending host update in ``offload/streams/updates.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..streams import Event, PendingGradients, SliceGradients


class Subscriber:
    """What a subscriber hears; each milestone does nothing unless overridden."""

    rewrites_gradients = False

    def forward_started(self, token: Any) -> None:
        pass

    def backward_started(self, token: Any, accumulates: bool) -> None:
        pass

    def wants_final_gradients(self, token: Any) -> bool:
        return False

    def final_parameters(self, token: Any) -> set[int]:
        return set()

    def gradients_produced(self, token: Any, index: int, grads: SliceGradients) -> None:
        pass

    def gradients_leaving(self, token: Any, index: int, pending: PendingGradients) -> None:
        pass

    def gradients_final(self, token: Any, index: int, grads: list[torch.Tensor | None], ready: Event | None) -> None:
        pass

    def gradients_landed(self, token: Any, pending: dict[int, PendingGradients]) -> None:
        pass


class Milestones:
    """The subscribers of one model's walks, called in subscription order."""

    def __init__(self) -> None:
        self.subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.append(subscriber)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers = [s for s in self.subscribers if s is not subscriber]

    @property
    def rewrite_gradients(self) -> bool:
        """Whether a subscriber rewrites the host gradients on their way."""
        return any(s.rewrites_gradients for s in self.subscribers)

    def backward_started(self, token: Any, accumulates: bool) -> None:
        for subscriber in self.subscribers:
            subscriber.backward_started(token, accumulates)

    def wants_final_gradients(self, token: Any) -> bool:
        return any(s.wants_final_gradients(token) for s in self.subscribers)

    def final_parameters(self, token: Any) -> set[int]:
        return set().union(*(s.final_parameters(token) for s in self.subscribers))

    def gradients_final(self, token: Any, index: int, grads: list[torch.Tensor | None], ready: Event | None) -> None:
        for subscriber in self.subscribers:
            subscriber.gradients_final(token, index, grads, ready)

    def forward_started(self, token: Any) -> None:
        for subscriber in self.subscribers:
            subscriber.forward_started(token)

    def gradients_produced(self, token: Any, index: int, grads: SliceGradients) -> None:
        for subscriber in self.subscribers:
            subscriber.gradients_produced(token, index, grads)

    def gradients_leaving(self, token: Any, index: int, pending: PendingGradients) -> None:
        for subscriber in self.subscribers:
            subscriber.gradients_leaving(token, index, pending)

    def gradients_landed(self, token: Any, pending: dict[int, PendingGradients]) -> None:
        for subscriber in self.subscribers:
            subscriber.gradients_landed(token, pending)
