"""Splitting a batch into microbatches and joining the results back.

A batch is any nested structure (tensor, tuple, list, dict) that flattens into leaves. The batch
size is dim 0 of the first tensor leaf that has a dim 0. A tensor leaf *carries the batch* when
its dim 0 has exactly that size; those leaves are cut along dim 0, every other leaf (a shared
mask, a config value) goes whole to every microbatch.

Note: [Joining outputs]
    The output side mirrors the input side: what was cut is joined, what went whole to every
    microbatch comes back whole. With several microbatches, each leaf of the flattened output:

    1. Has the same place in every microbatch's output: as many leaves, tensors in the same
       places. An output whose structure follows the rows (``list(y)``, one tensor a row) is
       refused, since uneven microbatches give it other lengths.
    2. A leaf that is not a tensor (a count, a float read from a tensor) passes through where it is
       equal in every microbatch (``==``; NaN equals NaN) and is refused where not: the plain model
       computes it once over the whole batch, which no microbatch does.
    3. A tensor whose dim 0 is its microbatch's rows in every microbatch is joined along dim 0,
       unless it is the same tensor in every microbatch (the same memory, viewed alike): rows cut
       from the batch lie in different memory. A tensor whose rows all lie in the same memory (an
       ``expand`` to the batch, dim-0 stride 0) is joined too.
    4. A tensor handed back whole, the first microbatch's: the same tensor in every microbatch
       (a ``[seq, seq]`` mask passed through, a buffer), whatever its dim 0; or one whose dim 0
       is not the microbatch's rows and whose values are equal in every microbatch (a mask made
       again in each). Not a scalar made in each microbatch: that is a statistic of the
       microbatch (a loss), even where the values happen to be equal. It must need no gradient: backward hands each output's gradient
       to the microbatches by cutting it along dim 0. One that needs a gradient is refused.
    5. Every other tensor (a loss computed in the model, a statistic of each microbatch) is refused.

    What rule 3 cannot see: a leaf in different memory in each microbatch whose dim 0 happens to
    be the rows is joined, even with equal values. A shared input on the host is loaded to the
    device once per microbatch, so a ``[seq, seq]`` mask passed through from there with ``seq``
    equal to the microbatch's rows is joined; put it on the device first (or give it a dim 0
    other than the microbatch's rows). And a tensor the same in every microbatch that the plain
    model would have given another dim 0 (``table[:rows]``) is handed back as the first
    microbatch's.

Note: [Chunks with a version counter of their own]
    A first layer may write its input in place (``ReLU(inplace=True)``, ``x.add_(1)``). In the
    plain model that writes the caller's tensor once, and a layer after it saves the written tensor
    at the version that write left. ``torch.split``'s chunks are views and share one version counter
    with the caller's tensor, so a later microbatch's write would bump the version an earlier
    microbatch's kept graph saved its input at, and backward would refuse a graph the plain model
    differentiates. So every chunk but the first of an input that needs no gradient is an alias of
    the same memory with a counter of its own (``set_``: writes still reach the caller's tensor,
    and no data is copied). The first chunk keeps the caller's counter, so a change of the input
    between forward and backward is still refused where the plain model refuses it, and the first
    layer's write bumps the caller's counter as in the plain model. An input that needs a gradient
    enters each slice through a copy (Note: [Leaves enter through a copy] in
    ``offload/autograd/slice_graph.py``), and an inference tensor has no counter: both stay views,
    as does a tensor that is not a plain strided one (a subclass's memory is not its storage's).

Note: [Sparse tensors carrying the batch]
    A sparse tensor whose dim 0 is the batch's (a bag of words a row) is cut as a strided one is,
    and what a slice gives back sparse with the microbatch's rows is joined again, so the plain
    model's results come out bit for bit: each row keeps its entries in their order.

    1. A COO tensor is cut with ``narrow_copy`` (a sparse tensor has no strided views): each chunk
       holds copies of its rows' indices and values, so a layer that writes a chunk in place does
       not write the caller's tensor. Outputs are joined with ``torch.cat``.
    2. A two-dimensional CSR tensor (dense dims after them allowed) is cut by its row pointers:
       the chunk's column indices and values are views of the caller's, found with one blocking
       read of the row pointers. Outputs are joined by their row pointers, which ``torch.cat``
       cannot do.
    3. Any other sparse layout carrying the batch (CSC, BSR, BSC, or CSR with batch dims) is
       refused, naming the input leaf, before any slice runs; as an output, where it is joined.
    4. A sparse tensor whose dim 0 is not the batch's (a graph's ``[nodes, nodes]`` adjacency
       beside a batch of graphs) goes whole to every microbatch, as any such leaf does, and comes
       back whole: rule 4 of Note: [Joining outputs] tells it by its indices' and values' memory,
       which a detach keeps.

Nothing here moves data between devices.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
import math
from typing import Any

import torch
import torch.autograd.forward_ad as forward_ad

_SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


@dataclass(frozen=True)
class Split:
    """How one batch was cut.

    Attributes:
        sizes: rows in each microbatch; one entry when the batch was not cut.
        carries_batch: for each flattened leaf, whether it was cut along dim 0.
    """

    sizes: tuple[int, ...]
    carries_batch: tuple[bool, ...]

    @property
    def count(self) -> int:
        return len(self.sizes)


def batch_size(leaves: Sequence[Any]) -> int | None:
    """Dim 0 of the first tensor leaf that has one, or None."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.shape[0])
    return None


def split_leaves(leaves: Sequence[Any], num_microbatches: int) -> tuple[list[list[Any]], Split]:
    """Cut flattened batch leaves into at most ``num_microbatches`` microbatches.

    A batch with fewer rows than ``num_microbatches`` is cut into one microbatch per row; a batch
    with no tensor that has a dim 0 is not cut. Microbatch sizes differ by at most one row.

    Under a ``torch.func`` transform (``vmap``, ``jvp``, ``jacfwd`` over the model under
    ``torch.no_grad()``) the batch is not cut: the transform's tensors have no memory the outputs
    could be joined by (Note: [Joining outputs]), and one run gives the plain model's result bit for
    bit, where a cut one might round otherwise.

    Returns:
        The leaves of each microbatch (views of the input, or aliases of its memory: Note: [Chunks
        with a version counter of their own]; no copies), and the :class:`Split`.
    """
    rows = batch_size(leaves)
    carries = tuple(
        isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and rows is not None and leaf.shape[0] == rows
        for leaf in leaves
    )
    if rows is None or num_microbatches == 1 or rows <= 1 or torch._C._are_functorch_transforms_active():
        return [list(leaves)], Split((rows if rows is not None else 0,), carries)
    count = min(num_microbatches, rows)
    sizes = tuple(rows // count + (1 if m < rows % count else 0) for m in range(count))
    for position, (leaf, cut) in enumerate(zip(leaves, carries)):
        if cut and leaf.layout in _SPARSE_LAYOUTS:
            _check_sparse_cut(position, leaf, sizes)
    per_leaf = [_chunks(leaf, sizes) if cut else [leaf] * count for leaf, cut in zip(leaves, carries)]
    return [[chunks[m] for chunks in per_leaf] for m in range(count)], Split(sizes, carries)


def _chunks(leaf: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """``leaf`` cut along dim 0, each chunk but the first with a version counter of its own where
    that can matter (Note: [Chunks with a version counter of their own])."""
    if leaf.layout in _SPARSE_LAYOUTS:
        return _sparse_chunks(leaf, sizes)
    chunks = list(torch.split(leaf, list(sizes), dim=0))
    if (leaf.requires_grad or not _plain_memory(leaf) or leaf.is_inference() or torch.is_inference_mode_enabled()
            or _has_tangent(leaf)):
        return chunks
    return [chunks[0], *(_own_version(chunk) for chunk in chunks[1:])]


def _check_sparse_cut(position: int, leaf: torch.Tensor, sizes: Sequence[int]) -> None:
    """Refuse, before anything runs, a sparse tensor carrying the batch that :func:`_sparse_chunks`
    cannot cut (Note: [Sparse tensors carrying the batch])."""
    if _rows_cut(leaf):
        return
    raise ValueError(
        f"the model's input leaf {position} (flattened in order) is a {leaf.layout} tensor of shape "
        f"{tuple(leaf.shape)} whose dim 0 is the batch's ({sum(sizes)} rows), so num_microbatches would cut it "
        f"into {len(sizes)} microbatches along dim 0, which OffloadModel does for a sparse COO tensor or a "
        "two-dimensional CSR one only (Note: [Sparse tensors carrying the batch] in offload/walk/microbatch.py). "
        "Convert it (.to_sparse_coo()); give it a dim 0 other than the batch's, to pass it whole to every "
        "microbatch; or use num_microbatches=1")


def _rows_cut(t: torch.Tensor) -> bool:
    """Whether a sparse tensor's rows can be cut and joined: COO, or CSR without batch dims."""
    return t.layout == torch.sparse_coo or (t.layout == torch.sparse_csr and t.dim() - t.dense_dim() == 2)


def _sparse_chunks(leaf: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """``leaf``, a sparse tensor, cut along dim 0 (Note: [Sparse tensors carrying the batch])."""
    starts = [sum(sizes[:m]) for m in range(len(sizes))]
    if leaf.layout == torch.sparse_coo:
        return [leaf.narrow_copy(0, start, rows) for start, rows in zip(starts, sizes)]
    crow = leaf.crow_indices()
    # Rows a:b hold the entries crow[a]:crow[b]: one blocking read of where each chunk's begin.
    # Pieces of a valid tensor need no invariant check (whose absence torch warns of unless told).
    bounds = crow[[*starts, sum(sizes)]].tolist()
    return [torch.sparse_csr_tensor(
        crow[a:a + rows + 1] - bounds[m], leaf.col_indices()[bounds[m]:bounds[m + 1]],
        leaf.values()[bounds[m]:bounds[m + 1]], (rows, *leaf.shape[1:]), check_invariants=False)
        for m, (a, rows) in enumerate(zip(starts, sizes))]


def _joined_sparse(position: int, per_microbatch: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sparse output tensors carrying the batch joined along dim 0, as :func:`_sparse_chunks` cut
    them (Note: [Sparse tensors carrying the batch])."""
    first = per_microbatch[0]
    if not all(_rows_cut(t) and t.layout == first.layout for t in per_microbatch):
        raise ValueError(
            f"output leaf {position} is a {first.layout} tensor of shape {tuple(first.shape)} carrying the batch "
            "dimension, which OffloadModel joins across microbatches for a sparse COO tensor or a two-dimensional "
            "CSR one only (Note: [Sparse tensors carrying the batch] in offload/walk/microbatch.py); return it as "
            "COO (.to_sparse_coo()) or dense, or use num_microbatches=1")
    if first.layout == torch.sparse_coo:
        return torch.cat(per_microbatch, dim=0)
    offsets = [0]
    for t in per_microbatch:
        offsets.append(offsets[-1] + t._nnz())
    crow = torch.cat([per_microbatch[0].crow_indices()[:1]] + [
        t.crow_indices()[1:] + offset for t, offset in zip(per_microbatch, offsets)])
    return torch.sparse_csr_tensor(
        crow, torch.cat([t.col_indices() for t in per_microbatch]), torch.cat([t.values() for t in per_microbatch]),
        (sum(t.shape[0] for t in per_microbatch), *first.shape[1:]), check_invariants=False)


def _has_tangent(t: torch.Tensor) -> bool:
    """Whether ``t`` is a dual tensor (``torch.autograd.forward_ad``): its views carry the tangent,
    an alias would not."""
    return forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None


def _plain_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are its storage's, read as they lie (what ``set_`` can alias)."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and not t.is_nested and not t.is_quantized
            and not t.is_conj() and not t.is_neg())


def _own_version(chunk: torch.Tensor) -> torch.Tensor:
    """An alias of ``chunk``'s memory, laid out alike, with a version counter of its own."""
    alias = torch.empty(0, dtype=chunk.dtype, device=chunk.device)
    return alias.set_(chunk.untyped_storage(), chunk.storage_offset(), chunk.size(), chunk.stride())


def join_outputs(outputs: Sequence[Sequence[Any]], sizes: Sequence[int], leave_out: Collection[int] = (),
                 requires: Sequence[bool] | None = None) -> list[Any]:
    """Join the flattened outputs of each microbatch into the outputs of the whole batch, by the
    rules of Note: [Joining outputs]. With one microbatch nothing is joined. Positions in
    ``leave_out`` (outputs rebuilt from another one: Note: [Outputs that alias each other] in
    ``offload/autograd/call.py``) are ``None``. ``requires``: whether each leaf needs a gradient
    (``None``: none does). A leaf handed back whole is the first microbatch's own object.

    Raises:
        ValueError: with several microbatches, the outputs differ in structure, or a leaf can be
            neither joined nor handed back whole.
    """
    if len(outputs) == 1:
        return [None if position in leave_out else leaf for position, leaf in enumerate(outputs[0])]
    check_alike(outputs)
    joined: list[Any] = []
    for position, per_microbatch in enumerate(zip(*outputs)):
        if position in leave_out:
            joined.append(None)
        elif not isinstance(per_microbatch[0], torch.Tensor):
            joined.append(_one_value(position, per_microbatch))
        else:
            needs_grad = requires is not None and requires[position]
            joined.append(_joined_tensor(position, per_microbatch, sizes, needs_grad))
    return joined


def check_alike(outputs: Sequence[Sequence[Any]]) -> None:
    """Raise unless every microbatch's flattened output has as many leaves as the first's, a
    tensor where it has one (rule 1 of Note: [Joining outputs])."""
    first = outputs[0]
    for m, leaves in enumerate(outputs[1:], start=1):
        if len(leaves) != len(first):
            differs = f"{len(first)} leaves in the first microbatch, {len(leaves)} in microbatch {m}"
        elif [isinstance(x, torch.Tensor) for x in leaves] != [isinstance(x, torch.Tensor) for x in first]:
            differs = f"tensors in other places in microbatch {m} than in the first"
        else:
            continue
        raise ValueError(
            f"the model's output differs in structure between microbatches ({differs}), so they cannot be "
            "joined into the whole batch's output; return the same structure whatever the number of rows (one "
            "tensor with the batch in dim 0, not a list of rows), or use num_microbatches=1")


def _one_value(position: int, per_microbatch: Sequence[Any]) -> Any:
    """A non-tensor leaf, equal in every microbatch (rule 2)."""
    first = per_microbatch[0]
    for m, value in enumerate(per_microbatch[1:], start=1):
        if not _equal_values(first, value):
            raise ValueError(
                f"output leaf {position} is a {type(first).__name__} that differs between microbatches ({first!r} "
                f"in the first, {value!r} in microbatch {m}): the plain model computes it once over the whole "
                "batch, which no microbatch gives. Return it as a tensor with one value per row in dim 0 (joined), "
                "compute it outside the model from the joined outputs, or use num_microbatches=1")
    return first


def _equal_values(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a value whose == is not a truth value (an array): not known to be equal
        return False


def _joined_tensor(position: int, per_microbatch: Sequence[torch.Tensor], sizes: Sequence[int],
                   needs_grad: bool) -> torch.Tensor:
    """A tensor leaf joined along dim 0 (rule 3), or handed back whole (rule 4)."""
    first = per_microbatch[0]
    carries = all(t.dim() >= 1 and t.shape[0] == rows for t, rows in zip(per_microbatch, sizes))
    same = _memory(first) is not None and all(_memory(t) == _memory(first) for t in per_microbatch[1:])
    if carries and not same and first.layout in _SPARSE_LAYOUTS:
        return _joined_sparse(position, per_microbatch)
    if carries and (not same or first.layout == torch.strided and first.stride(0) == 0):
        return torch.cat(per_microbatch, dim=0)
    if needs_grad:
        raise ValueError(
            f"output leaf {position} (shape {tuple(first.shape)}) does not carry the batch dimension (microbatch "
            f"sizes {list(sizes)}) and needs a gradient: backward hands each output's gradient to the "
            "microbatches by cutting it along dim 0, so it can be neither joined nor handed back whole (Note: "
            "[Joining outputs] in offload/walk/microbatch.py). Return it detached, compute it outside the model, "
            "or use num_microbatches=1")
    # A blocking read of the values, only where the leaf would be refused otherwise.
    # A scalar made in each microbatch is a statistic of it (a loss), equal or not.
    if not same and (first.dim() == 0 or not all(_equal_tensors(first, t) for t in per_microbatch)):
        raise ValueError(
            f"output leaf {position} (shape {tuple(first.shape)}) does not carry the batch dimension (microbatch "
            f"sizes {list(sizes)}) and is not the same in every microbatch, so it cannot be joined across "
            "microbatches; use num_microbatches=1 or return only per-row tensors from the last layer")
    return first


def _memory(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Where a plain tensor's elements lie and how they are read; ``None`` where that says nothing
    (an empty tensor has no memory, a subclass's is not its storage's). A sparse tensor's lie in its
    indices and values (one passed on whole, which each slice's input detaches)."""
    if type(t) is not torch.Tensor or t.numel() == 0:
        return None
    if t.layout in _SPARSE_LAYOUTS:
        if t._nnz() == 0:
            return None
        parts = (t._indices(), t._values()) if t.layout == torch.sparse_coo else (
            *_compressed_indices(t), t.values())
        return (t.layout, t.shape, *(_memory(p) for p in parts))
    if t.layout != torch.strided:
        return None
    return (t.untyped_storage().data_ptr(), t.device, t.dtype, t.storage_offset(), t.shape, t.stride(),
            t.is_conj(), t.is_neg())


def _compressed_indices(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A CSR, CSC, BSR or BSC tensor's compressed and plain indices."""
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return t.crow_indices(), t.col_indices()
    return t.ccol_indices(), t.row_indices()


def _equal_tensors(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device or a.layout != b.layout:
        return False
    try:
        if torch.equal(a, b):
            return True
        if not (a.is_floating_point() or a.is_complex()):
            return False
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
    except (RuntimeError, TypeError, NotImplementedError):  # a tensor torch.equal cannot compare
        return False


def view_in_joined(bases: Sequence[torch.Tensor], views: Sequence[torch.Tensor], joined: torch.Tensor,
                   ) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """Where the view each microbatch's output leaf takes of its base (``views`` of ``bases``) lies
    in the joined base: size, stride, and storage offset from the joined base's; ``None`` where it
    does not carry over. A base handed back whole is ``bases[0]`` itself; the view carries over
    where every microbatch's is alike.

    With several microbatches the view carries over only where each microbatch's base is laid out
    as ``joined`` and the view keeps all of its rows with its dim-0 stride, the rest alike in every
    microbatch (Note: [Outputs that alias each other] in ``offload/autograd/call.py``, rule 3).
    """
    first = views[0]
    offsets = [v.storage_offset() - b.storage_offset() for v, b in zip(views, bases)]
    if len(views) == 1:
        return tuple(first.shape), first.stride(), offsets[0]
    if joined is bases[0]:  # handed back whole (rule 4 of Note: [Joining outputs]): the view, alike in each
        alike = all(v.shape == first.shape and v.stride() == first.stride() and offset == offsets[0]
                    for v, offset in zip(views, offsets))
        return (tuple(first.shape), first.stride(), offsets[0]) if alike else None
    carries = all(
        b.stride() == joined.stride() and v.dim() >= 1 and v.shape[0] == b.shape[0] and v.stride(0) == b.stride(0)
        and v.shape[1:] == first.shape[1:] and v.stride() == first.stride() and offset == offsets[0]
        for v, b, offset in zip(views, bases, offsets)
    )
    if not carries:
        return None
    return (int(joined.shape[0]), *first.shape[1:]), first.stride(), offsets[0]


def split_like(leaf: torch.Tensor | None, sizes: Sequence[int]) -> list[torch.Tensor | None]:
    """Cut a gradient of a joined output tensor back into per-microbatch gradients.

    With one microbatch nothing was joined, whatever the output's dim 0 (e.g. rows of B*T); with
    several, :func:`join_outputs` concatenated every tensor output along dim 0.
    """
    if leaf is None:
        return [None] * len(sizes)
    if len(sizes) == 1:
        return [leaf]
    if leaf.layout in _SPARSE_LAYOUTS:  # a sparse output's gradient (its to_dense() in the loss gives one)
        if not _rows_cut(leaf):
            raise ValueError(
                f"the gradient of a sparse output ({leaf.layout}, shape {tuple(leaf.shape)}) cannot be cut along "
                f"dim 0 into the microbatches' (sizes {list(sizes)}): only COO and two-dimensional CSR gradients "
                "can (Note: [Sparse tensors carrying the batch] in offload/walk/microbatch.py). Return the output "
                "dense or as COO, or use num_microbatches=1")
        return _sparse_chunks(leaf, sizes)
    return list(torch.split(leaf, list(sizes), dim=0))


def join_input_grads(grads: Sequence[torch.Tensor | None], rows: Sequence[int], was_split: bool,
                     trailing_shape: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    """Join per-microbatch gradients of one input leaf.

    A leaf that was cut gets its microbatch gradients concatenated (zeros where a microbatch gave
    none); a leaf that went whole to every microbatch gets their sum.
    """
    if all(g is None for g in grads):
        return None
    if not was_split:
        total: torch.Tensor | None = None
        for g in grads:
            if g is not None:
                total = g if total is None else total + g
        return total
    parts = [
        g if g is not None else torch.zeros((n, *trailing_shape), dtype=dtype, device=_device_of(grads))
        for g, n in zip(grads, rows)
    ]
    return torch.cat(parts, dim=0)


def _device_of(grads: Sequence[torch.Tensor | None]) -> torch.device:
    return next(g.device for g in grads if g is not None)
