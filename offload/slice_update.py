"""One slice's share of an optimizer step, as work a host worker runs.

The user's optimizer class steps *proxies*: parameters that share the memory of the user's
parameters (the host copies) but are objects of their own, so that a proxy's ``.grad`` can hold the
gradient captured when ``step()`` was called while the user's ``.grad`` is already reset for the
next step. The optimizer state is keyed by the user's parameters, as the plain optimizer keys it,
through :class:`StateByProxy`; so ``state_dict()`` has the plain optimizer's format, and, because
every ``torch.optim`` update treats each parameter on its own, stepping a slice's parameters (in
chunks) gives bit for bit what stepping all of them at once gives.

A slice is stepped in chunks of parameters that fit in the CPU caches: under a compute dtype each
chunk's fresh masters are cast into the slice's shadow right after their update, while they are
still in cache, instead of in a separate pass over host memory before the next load.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .streams.host_storage import SliceStorage, typed_view


class StateByProxy(MutableMapping[torch.Tensor, dict[str, Any]]):
    """An inner optimizer's ``state``: what it keeps for a proxy is kept for the user's parameter,
    in the outer optimizer's own ``state`` (which ``load_state_dict`` may replace)."""

    def __init__(self, outer: torch.optim.Optimizer, owner: dict[torch.Tensor, torch.Tensor]) -> None:
        self.outer = outer
        self.owner = owner  # proxy -> the user's parameter

    def __getitem__(self, proxy: torch.Tensor) -> dict[str, Any]:
        return self.outer.state[self.owner[proxy]]  # a defaultdict: made on first use, as in torch.optim

    def __setitem__(self, proxy: torch.Tensor, value: dict[str, Any]) -> None:
        self.outer.state[self.owner[proxy]] = value

    def __delitem__(self, proxy: torch.Tensor) -> None:
        del self.outer.state[self.owner[proxy]]

    def __contains__(self, proxy: object) -> bool:
        return proxy in self.owner and self.owner[proxy] in self.outer.state  # type: ignore[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (proxy for proxy, param in self.owner.items() if param in self.outer.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass
class Chunk:
    """Parameters of one slice stepped together, by one inner optimizer."""

    optimizer: torch.optim.Optimizer
    proxies: list[nn.Parameter]
    params: list[torch.Tensor]
    group_of: list[int]  # per inner group: the index of the user's group it comes from
    entries: list[int] = field(default_factory=list)  # storage entries whose shadow it writes


@dataclass
class SliceStep:
    """Everything needed to step one slice's parameters: its chunks and its storage."""

    index: int
    storage: SliceStorage | None  # None: parameters outside the model, stepped where step() is called
    chunks: list[Chunk]

    def needs_bind(self) -> bool:
        """Whether a parameter's memory moved since the proxies were pointed at it."""
        return any(proxy.data_ptr() != param.data_ptr() or proxy.shape != param.shape or proxy.dtype != param.dtype
                   for chunk in self.chunks for proxy, param in zip(chunk.proxies, chunk.params))

    def bind(self) -> None:
        """Point the proxies at the parameters' current memory (it moves when a slice is laid out
        again); called in the caller's thread before the work is submitted."""
        for chunk in self.chunks:
            for proxy, param in zip(chunk.proxies, chunk.params):
                proxy.data = param.data

    def run(self, grads: Sequence[Sequence[torch.Tensor | None]], hyper: Sequence[dict[str, Any]],
            grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Step every chunk with the captured gradients and hyperparameters, then write the
        shadow (if the slice has one) from the fresh masters, chunk by chunk."""
        shadow = self.storage.shadow if self.storage is not None else None
        for chunk, chunk_grads in zip(self.chunks, grads):
            if any(g is not None for g in chunk_grads):
                for proxy, grad in zip(chunk.proxies, chunk_grads):
                    proxy.grad = grad
                for group, source in zip(chunk.optimizer.param_groups, chunk.group_of):
                    group.update(hyper[source])
                chunk.optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
                chunk.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
                try:
                    chunk.optimizer.step()
                finally:
                    for proxy in chunk.proxies:
                        proxy.grad = None
            if shadow is not None:
                self._cast(chunk.entries)
        if shadow is not None:
            self._cast(self._entries_left())
            assert self.storage is not None
            self.storage.shadow_written()

    def _cast(self, entries: Sequence[int]) -> None:
        storage = self.storage
        assert storage is not None and storage.shadow is not None
        with torch.no_grad():
            for k in entries:
                entry = storage.entries[k]
                typed_view(storage.shadow, entry.device_offset, entry.device_dtype, entry.shape).copy_(entry.tensor)

    def _entries_left(self) -> list[int]:
        """Entries no chunk writes: parameters this optimizer does not step, and buffers."""
        assert self.storage is not None
        written = {k for chunk in self.chunks for k in chunk.entries}
        return [k for k in range(len(self.storage.entries)) if k not in written]


def chunked(params: Sequence[torch.Tensor], chunk_bytes: int) -> list[list[int]]:
    """Consecutive runs of parameter positions, each at most ``chunk_bytes`` (or one parameter)."""
    runs: list[list[int]] = []
    size = 0
    for position, param in enumerate(params):
        nbytes = param.numel() * param.element_size()
        if not runs or size + nbytes > chunk_bytes:
            runs.append([])
            size = 0
        runs[-1].append(position)
        size += nbytes
    return runs
