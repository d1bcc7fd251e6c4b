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

Loading a slice waits for its pending host update in ``offload/streams/updates.py``.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..streams import PendingGradients, SliceGradients


class Subscriber(Protocol):
    def forward_started(self, token: Any) -> None: ...

    def gradients_produced(self, token: Any, index: int, grads: SliceGradients) -> None: ...

    def gradients_leaving(self, token: Any, index: int, pending: PendingGradients) -> None: ...

    def gradients_landed(self, token: Any, pending: dict[int, PendingGradients]) -> None: ...


class Milestones:
    """The subscribers of one model's walks, called in subscription order."""

    def __init__(self) -> None:
        self.subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.append(subscriber)

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
