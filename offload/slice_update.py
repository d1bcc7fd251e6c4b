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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .streams.host_storage import SliceStorage


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
    """Parameters of one slice stepped together, by one inner optimizer over their proxies."""

    optimizer: torch.optim.Optimizer
    proxies: list[nn.Parameter]
    params: list[torch.Tensor]
    group_of: list[int]  # per inner group: the index of the user's group it comes from
    positions: list[int]  # where its parameters are in the slice's list
    entries: list[int]  # the storage entries of its parameters (for the shadow)

    def step(self, grads: Sequence[torch.Tensor | None], hyper: Sequence[dict[str, Any]],
             grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        if all(g is None for g in grads):
            return
        for proxy, grad in zip(self.proxies, grads):
            proxy.grad = grad
        for group, source in zip(self.optimizer.param_groups, self.group_of):
            group.update(hyper[source])
        self.optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            self.optimizer.step()
        finally:
            for proxy in self.proxies:
                proxy.grad = None


class HostUpdateError(RuntimeError):
    """The optimizer raised while a host worker updated a slice (raised at the next call that
    waits for the update: a forward, ``step()``, ``synchronize()``...)."""


@dataclass
class SliceStep:
    """Everything needed to step one slice's parameters.

    Attributes:
        whole: one inner optimizer over all of the slice's parameters.
        chunks: inner optimizers over cache-sized runs of them, used once their state exists when
            the slice has a shadow to write; empty otherwise.
    """

    index: int
    storage: SliceStorage | None  # None: parameters outside the model, stepped where step() is called
    whole: Chunk | None  # None: this rank owns none of the slice's parameters (sharded update)
    chunks: list[Chunk]
    writes_shadow: bool = True  # sharded, the shadow is written after the other ranks' parts arrive

    def needs_bind(self) -> bool:
        """Whether a parameter's memory moved since the proxies were pointed at it."""
        if self.whole is None:
            return False
        return any(proxy.data_ptr() != param.data_ptr() or proxy.shape != param.shape or proxy.dtype != param.dtype
                   for proxy, param in zip(self.whole.proxies, self.whole.params))

    def bind(self) -> None:
        """Point the proxies at the parameters' current memory (it moves when a slice is laid out
        again); called in the caller's thread before the work is submitted."""
        if self.whole is None:
            return
        for proxy, param in zip(self.whole.proxies, self.whole.params):
            proxy.data = param.data

    def run(self, grads: Sequence[torch.Tensor | None], hyper: Sequence[dict[str, Any]],
            grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """Step the slice with the gradients (aligned with ``whole.params``) and hyperparameters
        captured by ``step()``, then write its shadow, if it has one, from the fresh masters.

        Chunk by chunk once the optimizer state exists, so each chunk is cast while in cache; in
        one step of the whole slice otherwise (the first step), so that an optimizer that fails
        while setting up its state leaves the slice as it was.

        Raises:
            HostUpdateError: the optimizer raised.
        """
        shadow = self.writes_shadow and self.storage is not None and self.storage.shadow is not None
        assert self.whole is not None
        try:
            if self.chunks and self._state_ready(grads):
                for chunk in self.chunks:
                    chunk.step([grads[k] for k in chunk.positions], hyper, grad_scale, found_inf)
                    if shadow:
                        self._cast(chunk.entries)
                if shadow:
                    self._cast(self._entries_left())
            else:
                self.whole.step(grads, hyper, grad_scale, found_inf)
                if shadow:
                    assert self.storage is not None
                    self._cast(list(range(len(self.storage.entries))))
        except Exception as error:
            raise HostUpdateError(
                f"the optimizer raised while updating slice {self.index} of the model on the host: slices "
                f"before it are updated and slices after it were left as they were; slice {self.index} is "
                "unchanged if the optimizer raised before changing it (checking its arguments, allocating its "
                "state) and may be partly updated otherwise. Reload a checkpoint before training on."
            ) from error
        if shadow:
            assert self.storage is not None
            self.storage.shadow_written()

    def _state_ready(self, grads: Sequence[torch.Tensor | None]) -> bool:
        assert self.whole is not None
        state = self.whole.optimizer.state
        return all(g is None or state[proxy] for proxy, g in zip(self.whole.proxies, grads))

    def _cast(self, entries: Sequence[int]) -> None:
        """Write the shadow of ``entries`` (consecutive runs of them at a time)."""
        storage = self.storage
        assert storage is not None
        start = 0
        for k in range(1, len(entries) + 1):
            if k == len(entries) or entries[k] != entries[k - 1] + 1:
                storage.write_shadow(entries[start], entries[k - 1] + 1)
                start = k

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
