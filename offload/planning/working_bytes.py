"""What a layer holds for a moment beyond what it saves: counted on the profile's fake tensors.

:class:`TransientBytes` follows the storages a layer's forward makes, and :class:`NodeBytes`
the storages each node of the backward makes (Note: [Working bytes beyond the saved]). Fake
storages allocate nothing, but they are freed as real ones are, when the last tensor on them
goes: a weak reference to a storage says when (``torch.UntypedStorage._weak_ref``, the one
``torch.multiprocessing``'s ``StorageWeakRef`` holds).

``shapes.py`` runs them and keeps the figures in each layer's profile; ``planner.py`` adds them to
the device's activations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Note: [Working bytes beyond the saved]
#     A slice's device peak is what its graph saves plus what it holds for a moment, in its
#     recompute's forward or in its backward. Two such moments outgrow the gradient the size of
#     the largest saved tensor that the planner counted for them, both measured op by op on a CPU
#     "device" (``tests/test_planning_lora_device.py``):
#     1. The forward's transients: tensors a layer makes and neither saves nor returns, alive
#        while the Python frames that made them run. In a 4-bit LoRA decoder's ``down_proj``
#        (bitsandbytes' ``gemm_4bit`` saves nothing for a frozen weight) the MLP's product that
#        enters it, the decoder's residual and its normed input, the base's output and the
#        adapter's float32 output, its scaled copy and their float32 sum are all there at once:
#        4.5 MB beside the 2 MB largest saved tensor, QLoRA's peak at four slices (the step took
#        18 % more than the estimate). :class:`TransientBytes` counts the most of them alive at
#        once in the layer's forward, less the tensors it saves that are not made yet then.
#     2. The node that sums: where two operations read one tensor (Note: [Gradients summed in
#        backward] in ``shapes.py``), the second node's backward runs while the first's gradient
#        waits for it, holding its own gradient in and what its formula makes: an RMSNorm's
#        ``pow`` backward makes three float32 tensors of the hidden state's size (``x**1``, its
#        double, the product with the gradient), five of that size with the waiting one and its
#        incoming gradient, where the sum afterwards holds three. :class:`NodeBytes` counts the
#        most bytes alive at once of the storages each node's operations make (views none).
#        The head's norm is that node in a chunked head, at two slices the peak beside the last
#        decoder's saved tensors (the step took 18 % more than the estimate with LoRA, 12 % with
#        QLoRA).


class TransientBytes(TorchDispatchMode):
    """The storages one layer's forward makes, each with the operations it lived through: run
    the forward under it, then ask :meth:`most_beyond` with what the layer saved and returned."""

    def __init__(self) -> None:
        super().__init__()
        self._ops = 0
        self._alive: dict[int, tuple[Any, int, int]] = {}  # storage id: weak reference, bytes, first op
        self._lived: list[tuple[int, int, int, int]] = []  # storage id, bytes, first op, last op + 1
        self._refs: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._ops += 1
        self._forget_freed()
        for key, storage in _new_storages(args, kwargs, out).items():
            if key not in self._alive:
                self._alive[key] = (storage._weak_ref(), storage.nbytes(), self._ops)
        return out

    def _forget_freed(self, every: bool = False) -> None:
        for key, (ref, nbytes, first) in list(self._alive.items()):
            if every or torch.UntypedStorage._expired(ref):
                del self._alive[key]
                self._lived.append((key, nbytes, first, self._ops + (1 if every else 0)))
                # The reference is let go at the end only: until then no storage the layer makes
                # takes a freed one's address, the id that ``most_beyond`` tells them apart by.
                self._refs.append(ref)

    def most_beyond(self, saved: dict[int, int], returned: set[int]) -> int:
        """The most bytes alive at once, after any operation, beyond all the layer saves: of the
        storages made that it neither saves nor returns, less its saved ones made later."""
        self._forget_freed(every=True)
        for ref in self._refs:
            torch.UntypedStorage._free_weak_ref(ref)
        self._refs.clear()
        changes: dict[int, int] = {}
        alive = most = 0
        for key, nbytes, first, end in self._lived:
            if key in saved:  # not there before the operation that made it
                alive -= nbytes
                changes[first] = changes.get(first, 0) + nbytes
            elif key not in returned:
                changes[first] = changes.get(first, 0) + nbytes
                changes[end] = changes.get(end, 0) - nbytes
        for op in sorted(changes):
            alive += changes[op]
            most = max(most, alive)
        return most


class NodeBytes(TorchDispatchMode):
    """Per node of a backward (by its sequence number), the most bytes alive at once of the
    storages its operations make: its gradients and what its formula makes on the way (Note:
    [Working bytes beyond the saved], rule 2). Empty in a PyTorch that does not say which node
    runs."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, int] = {}
        self._current = getattr(torch._C, "_current_autograd_node", lambda: None)
        self._node: int | None = None  # the node whose storages ``_alive`` holds
        self._alive: dict[int, tuple[Any, int]] = {}  # storage id: weak reference, bytes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        node = self._current()
        if node is None:
            return out
        number = node._sequence_nr()
        self._forget(every=number != self._node)
        self._node = number
        for key, storage in _new_storages(args, kwargs, out).items():
            self._alive.setdefault(key, (storage._weak_ref(), storage.nbytes()))
        self.made[number] = max(self.made.get(number, 0), sum(nbytes for _, nbytes in self._alive.values()))
        return out

    def __exit__(self, *exc: Any) -> Any:
        self._forget(every=True)
        return super().__exit__(*exc)

    def _forget(self, every: bool) -> None:
        for key, (ref, _) in list(self._alive.items()):
            if every or torch.UntypedStorage._expired(ref):
                torch.UntypedStorage._free_weak_ref(ref)
                del self._alive[key]


def _new_storages(args: tuple, kwargs: dict | None, out: Any) -> dict[int, Any]:
    """The storages of an operation's outputs that none of its arguments has (a view's is its
    base's: made earlier, or a parameter's)."""
    read = {storage._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
            for storage in _storages(t)}
    storages = {}
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            storages.update((storage._cdata, storage) for storage in _storages(t) if storage._cdata not in read)
    return storages


def _storages(t: torch.Tensor) -> list[Any]:
    """The storages that hold a tensor's memory. A sparse one has none of its own: its indices
    and values have theirs (``nn.Embedding(sparse=True)``'s gradient, made in backward)."""
    if t.layout == torch.sparse_coo:
        return [t._indices().untyped_storage(), t._values().untyped_storage()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices().untyped_storage(), t.col_indices().untyped_storage(), t.values().untyped_storage()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices().untyped_storage(), t.row_indices().untyped_storage(), t.values().untyped_storage()]
    return [t.untyped_storage()]
