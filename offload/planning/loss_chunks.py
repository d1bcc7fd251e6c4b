"""A chunked loss profiled in a few chunks: the planner's time does not grow with the batch.

Note: [Loss chunks profiled once]
    A Hugging Face head with ``loss_chunk_tokens`` (``Head.loss_sums`` in
    ``offload/integrations/transformers_layers.py``) computes the loss of the flattened batch a
    chunk at a time, each chunk a checkpointed ``Head._chunk`` of the same shape but the last. On
    fake tensors every chunk still costs its dispatches (its forward, then its recompute and its
    backward, and the loop's own), so a batch of 8192 rows of 128 tokens (1024 chunks) took a
    minute and a half to plan, 100000 rows more than five. What a chunk adds to the profile
    depends on its shape alone, so :class:`RepeatedChunks` runs one chunk of each shape:

    1. While the head is profiled its loop takes the batch in one piece, which the stand-in for
       ``Head._chunk`` cuts as the loop would have: the full chunks, then the rest.
    2. The first full chunk and the rest run as they are: their operations are counted by the
       layer's counter, and what they save for backward (views of the head's input and the
       labels, whose storages every chunk shares) by the layer's pack hook.
    3. The other full chunks, together, are an empty tensor of their losses' shape and dtype, with
       a backward that gives their input a zero gradient and counts nothing; they save nothing the
       first did not (the same storages).
    4. After the model's backward, :meth:`RepeatedChunks.flops` runs one full chunk on its own,
       under a counter of its own (counters nest: outside the others), its forward and its
       backward apart, and returns those operations times the full chunks that skipped them:
       added to the head's forward and to the model's backward, the figures are those of the
       loop over every chunk, to the operation.
    5. The chunks' losses return joined in one tensor, which the loop's next operation may save
       (an ``index_add`` does): :meth:`RepeatedChunks.as_looped` counts that storage as the
       loop's chunks' own, one entry for the full chunks (their count times one chunk's bytes)
       and one for the rest, the same bytes in all. An entry a chunk would grow with the batch as
       the work does not: 10**10 rows of 2 tokens took 7.5 GB to plan. So the profile's saved
       bytes are the loop's, in total and in the largest tensor beside the head's input
       (``tests/test_planning.py`` compares them).
    6. The graph the stand-in builds is not the loop's: its pieces of the head's input are slices
       of one tensor, whose gradients autograd sums, where the loop's split has none to sum.
       :meth:`RepeatedChunks.made_by_chunks` says which nodes the stand-in made (by sequence
       number), so that the planner leaves their sums out (Note: [Gradients summed in backward]
       in ``shapes.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


@dataclass
class _Skipped:
    """Full chunks of one head's loss that did not run (rule 3): the function, one chunk's inputs,
    whether its loss has a gradient, the layer and how many chunks."""

    chunk: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    hidden: torch.Tensor
    targets: torch.Tensor
    requires_grad: bool
    layer: int
    count: int


class RepeatedChunks:
    """A chunked loss's chunks, each shape run once (Note: [Loss chunks profiled once]).

    Args:
        flop_counter: makes the counter the profile counts operations with (``shapes.py``'s).
    """

    def __init__(self, flop_counter: Callable[[], FlopCounterMode]) -> None:
        self._flop_counter = flop_counter
        self._skipped: list[_Skipped] = []
        #: The joined losses by their storage, each with the bytes of the loop's chunks' losses,
        #: full chunks and rest, as (bytes of one, count) (rule 5); held, so that no other
        #: storage takes that address while the profile runs.
        self._joined: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}
        # Keys for those chunks' storages: below 0, which no storage's (an address) is.
        self._keys = itertools.count(-1, -1)
        # The sequence numbers of the nodes the stand-in made (rule 6), a range per call.
        self._made: list[range] = []
        self._next_node = getattr(torch._C._autograd, "_get_sequence_nr", None)

    @contextlib.contextmanager
    def patched(self, layer: nn.Module, index: int) -> Iterator[None]:
        """``layer``'s loss cut as rule 1 says while the context lasts, if it is a chunked head."""
        if not chunked_head(layer):
            yield
            return
        size, chunk = layer.loss_chunk_tokens, layer._chunk
        layer._chunk = lambda hidden, targets: self._chunks(chunk, index, size, hidden, targets)
        layer.loss_chunk_tokens = sys.maxsize  # the batch in one piece (rule 1)
        try:
            yield
        finally:
            del layer._chunk  # the method again
            layer.loss_chunk_tokens = size

    def _chunks(self, chunk: Callable[..., torch.Tensor], index: int, size: int, hidden: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
        first = self._next_node() if self._next_node is not None else 0
        try:
            return self._cut(chunk, index, size, hidden, targets)
        finally:
            self._made.append(range(first, self._next_node() if self._next_node is not None else 0))

    def made_by_chunks(self, sequence_nr: int) -> bool:
        """Whether the stand-in made the node numbered so (rule 6); every node where this
        PyTorch does not number them."""
        return self._next_node is None or any(sequence_nr in made for made in self._made)

    def _cut(self, chunk: Callable[..., torch.Tensor], index: int, size: int, hidden: torch.Tensor,
             targets: torch.Tensor) -> torch.Tensor:
        whole = hidden.shape[0] // size * size  # the tokens in full chunks
        losses = []
        if whole:
            losses.append(chunk(hidden[:size], targets[:size]))  # rule 2
        if whole > size:  # rule 3
            requires_grad = losses[0].requires_grad
            self._skipped.append(_Skipped(chunk, hidden[:size], targets[:size], requires_grad, index,
                                          whole // size - 1))
            like = losses[0].new_empty((whole - size, *losses[0].shape[1:]))
            # In the graph as the chunks would be: from their input (or from a leaf of their own
            # where the input has no gradient: the head's weight alone trains).
            anchor = hidden[size:whole] if hidden.requires_grad else torch.empty(0, requires_grad=True)
            losses.append(_SkippedLosses.apply(anchor, like) if requires_grad else like)
        if whole < hidden.shape[0]:
            losses.append(chunk(hidden[whole:], targets[whole:]))  # rule 2: the rest
        if len(losses) == 1:
            return losses[0]
        joined = torch.cat(losses)
        full = (losses[0].untyped_storage().nbytes(), whole // size)
        rest = (losses[-1].untyped_storage().nbytes(), int(whole < hidden.shape[0]))
        self._joined[joined.untyped_storage()._cdata] = joined, [c for c in (full, rest) if c[1]]
        return joined

    def as_looped(self, saved: dict[int, int]) -> dict[int, int]:
        """``saved`` (a layer's saved bytes by storage) with the joined losses' storage, where it
        is there, as the loop's chunks' storages: the full ones as one, and the rest (rule 5)."""
        for storage in self._joined.keys() & saved.keys():
            del saved[storage]
            saved.update((next(self._keys), nbytes * count) for nbytes, count in self._joined[storage][1])
        return saved

    def flops(self) -> tuple[dict[int, int], int]:
        """The operations the skipped chunks did not run: by layer in the forward, and in the
        backward (rule 4). Call it after the model's backward, with no counter running."""
        forward: dict[int, int] = {}
        backward = 0
        for skipped in self._skipped:
            hidden = skipped.hidden.detach().requires_grad_(skipped.hidden.requires_grad)
            with torch.set_grad_enabled(skipped.requires_grad), self._flop_counter() as counter:
                loss = skipped.chunk(hidden, skipped.targets)
                ran = counter.get_total_flops()
                if loss.requires_grad:
                    torch.autograd.backward(loss, torch.ones_like(loss))
            forward[skipped.layer] = forward.get(skipped.layer, 0) + skipped.count * ran
            backward += skipped.count * (counter.get_total_flops() - ran)
        return forward, backward


def chunked_head(layer: nn.Module) -> bool:
    """Whether ``layer`` is a Hugging Face head that computes its loss in chunks."""
    layers = sys.modules.get("offload.integrations.transformers_layers")
    # (no such head exists before its module is imported)
    return layers is not None and isinstance(layer, layers.Head) and bool(layer.loss_chunk_tokens)


class _SkippedLosses(torch.autograd.Function):
    """The skipped chunks' losses in the graph: a zero gradient for their input (Note: [Loss
    chunks profiled once], rule 3); the operations their backward would run are counted by
    :meth:`RepeatedChunks.flops`."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        ctx.anchor = anchor.shape, anchor.dtype, anchor.device  # not the tensor: nothing saved
        return torch.empty_like(like)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        shape, dtype, device = ctx.anchor
        return torch.zeros(shape, dtype=dtype, device=device), None
