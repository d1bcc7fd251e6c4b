"""One call's structure across the autograd Function's boundary.

``autograd.Function.apply`` takes and returns flat tensors; a model input or output is any nested
structure (tensor, tuple, list, dict, and the containers of Note: [Containers pytree keeps whole]
in ``offload/walk/structures.py``) with values that are not tensors among its leaves. A
:class:`Call` takes the input apart on the model's side, puts it back together inside the
Function's forward, and does the same for the output on the way back: one owner for both ends.

Note: [Outputs that alias each other]
    A last layer may return one tensor twice, or a tensor and a view of it (``(x, x[:, :2])``). In
    the plain model autograd knows the view: an in-place change of one output reaches the other,
    its values and its gradient (``CopySlices``). A Function's results are unrelated tensors to
    autograd, and joined microbatches do not even share memory. So the Function returns each
    *base* once, and :meth:`Call.output_with` rebuilds every output the base holds outside it, as
    the base again or as ``as_strided`` over it, a view autograd records.

    1. A slice's outputs leave it detached, which loses identity: an output with its base's exact
       layout is taken to be the base (``a is b``). ``(x, x.view_as(x))`` comes back as one tensor
       twice: the same values and gradients, one object fewer than the plain model's.
    2. An output is rebuilt when another holds every element of it, in the same storage and dtype
       and with the same need for a gradient (``(x, x.detach())`` stays two results). A holder has
       the same layout, or covers its extent densely (``x``, ``x.t()``, not ``x[:, :3]``) with the
       other within it. Outputs that overlap otherwise (``x[:, :-1], x[:, 1:]``) stay separate
       results: exact unless one is changed in place.
    3. Over several microbatches a view is rebuilt over the joined base where its layout carries
       over: every microbatch's base laid out as the joined one, the view keeping all of the
       base's rows with the base's dim-0 stride (``x[:, :2]``, ``x[..., k]``). Any other view
       (of a transposed base, say) is joined as a result of its own, as outputs that overlap
       otherwise are: exact unless one of them is changed in place. A base handed back whole
       (rule 4 of Note: [Joining outputs] in ``offload/walk/microbatch.py``) keeps a view where
       every microbatch's view of it is alike.
    4. The Function's gradients for the rebuilt outputs' places are ``None``: autograd sends what
       reaches a rebuilt view to its base, as in the plain model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import TreeSpec

from ..walk.microbatch import check_alike, join_outputs, view_in_joined
from ..walk.structures import flatten, unflatten


def flatten_input(value: Any, compute_dtype: torch.dtype | None) -> tuple[list[Any], TreeSpec]:
    """The model input's leaves, floating-point tensors cast to ``compute_dtype`` if one is given.

    Cast here, outside the Function, so that autograd casts the input gradient back to the
    input's dtype.
    """
    leaves, spec = flatten(value, "the model's input")
    if compute_dtype is not None:
        leaves = [x.to(compute_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                  for x in leaves]
    return leaves, spec


@dataclass(frozen=True)
class OutputAlias:
    """An output leaf rebuilt outside the Function from another one, its base (Note: [Outputs that
    alias each other]).

    Attributes:
        position: the leaf rebuilt.
        base: the leaf it is rebuilt from, one of the Function's results.
        view: ``None`` for the base itself; else the view's size, stride and storage offset from
            the base's.
    """

    position: int
    base: int
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None

    @classmethod
    def of(cls, position: int, base: int, per_microbatch: Sequence[Sequence[Any]],
           joined_base: torch.Tensor) -> OutputAlias | None:
        """Leaf ``position`` of each microbatch's output, held by leaf ``base``, over the joined
        base; ``None`` where the view does not carry over to it (rule 3)."""
        views, bases = [leaves[position] for leaves in per_microbatch], [leaves[base] for leaves in per_microbatch]
        if all(_same_layout(v, b) for v, b in zip(views, bases)):
            return cls(position, base, None)
        view = view_in_joined(bases, views, joined_base)
        return None if view is None else cls(position, base, view)

    def over(self, base: torch.Tensor) -> torch.Tensor:
        """This leaf, from the base autograd returned: a view autograd records."""
        if self.view is None:
            return base
        size, stride, offset = self.view
        return base.as_strided(size, stride, base.storage_offset() + offset)


@dataclass(eq=False)  # compared and hashed by identity: milestone subscribers key on it
class Call:
    """One call's structure, shared by the model and the Function (never stored on the module).

    Tensor leaves travel as the Function's arguments and results; the call keeps the rest of each
    structure with ``None`` in their places.
    """

    input_spec: TreeSpec
    input_leaves: list[Any]  # tensors replaced by None
    tensor_positions: list[int]
    output_spec: TreeSpec | None = None
    output_leaves: list[Any] = field(default_factory=list)  # tensors replaced by None
    output_tensor_positions: list[int] = field(default_factory=list)  # the Function's results
    output_aliases: list[OutputAlias] = field(default_factory=list)  # the other tensor leaves
    # Forward-mode AD's switch where the model was called: autograd turns it off inside a Function's
    # forward, and a layer that makes dual tensors itself must run under the caller's (Note:
    # [Forward-mode AD inside a layer] in offload/autograd/function.py).
    forward_grad_enabled: bool = field(default_factory=torch._C._is_fwd_grad_enabled)

    @classmethod
    def taking(cls, leaves: Sequence[Any], spec: TreeSpec) -> tuple[Call, list[torch.Tensor]]:
        """A call for the input ``leaves``, and the tensors among them: the Function's arguments."""
        positions = [k for k, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        call = cls(spec, [None if isinstance(x, torch.Tensor) else x for x in leaves], positions)
        return call, [leaves[k] for k in positions]

    @property
    def num_input_tensors(self) -> int:
        return len(self.tensor_positions)

    def input_with(self, tensors: Sequence[torch.Tensor]) -> list[Any]:
        """The input's leaves, the Function's tensor arguments back in their places."""
        leaves = list(self.input_leaves)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return leaves

    def returning(self, per_microbatch: Sequence[Sequence[Any]], spec: TreeSpec, sizes: Sequence[int],
                  requires: Sequence[bool]) -> tuple[torch.Tensor, ...]:
        """Remember the output's structure and join the microbatches' output ``leaves``; the
        Function's results are the joined tensors no other output holds (Note: [Outputs that alias
        each other]). ``requires``: whether each leaf needs a gradient.

        Raises:
            ValueError: the outputs cannot be joined across microbatches (Note: [Joining outputs] in
                ``offload/walk/microbatch.py``).
        """
        self.output_spec = spec
        check_alike(per_microbatch)  # before anything reads a leaf by its place
        bases = _bases(per_microbatch, requires)
        joined = join_outputs(per_microbatch, sizes, leave_out=bases.keys(), requires=requires)
        self.output_aliases = []
        for p, b in sorted(bases.items()):
            alias = OutputAlias.of(p, b, per_microbatch, joined[b])
            if alias is None:  # joined as a result of its own (rule 3)
                own = [[leaves[p]] for leaves in per_microbatch]
                joined[p] = join_outputs(own, sizes, requires=[requires[p]])[0]
            else:
                self.output_aliases.append(alias)
        rebuilt = {alias.position for alias in self.output_aliases}
        self.output_tensor_positions = [p for p, leaf in enumerate(joined) if isinstance(leaf, torch.Tensor)]
        self.output_leaves = [None if isinstance(leaf, torch.Tensor) or p in rebuilt else leaf
                              for p, leaf in enumerate(joined)]
        return tuple(joined[p] for p in self.output_tensor_positions)

    def output_with(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The output structure around the tensors autograd returned from the Function."""
        leaves = list(self.output_leaves)
        for position, tensor in zip(self.output_tensor_positions, tensors):
            leaves[position] = tensor
        for alias in self.output_aliases:  # bases are results, never aliases themselves
            leaves[alias.position] = alias.over(leaves[alias.base])
        assert self.output_spec is not None, "the Function's forward sets the output structure"
        return unflatten(leaves, self.output_spec)


# -- outputs that alias each other (Note: [Outputs that alias each other]) ---------------------------


def _bases(per_microbatch: Sequence[Sequence[Any]], requires: Sequence[bool]) -> dict[int, int]:
    """For each output leaf that another one holds, the position of that base.

    Raises:
        ValueError: the outputs alias each other differently in different microbatches.
    """
    found = [bases_among(leaves, requires) for leaves in per_microbatch]
    if any(f != found[0] for f in found[1:]):
        raise ValueError("the model's outputs share memory differently in different microbatches, so they "
                         "cannot be joined; use num_microbatches=1")
    return found[0]


def bases_among(leaves: Sequence[Any], requires: Sequence[bool]) -> dict[int, int]:
    """For each leaf that another one holds (rule 2), the position of that base; ``requires``:
    whether each leaf needs a gradient. Boundary leaves use it too (Note: [Boundary leaves that
    alias each other] in ``offload/autograd/slice_graph.py``)."""
    # The usual case, every slice's boundary in forward and backward: no two leaves share a storage,
    # so none holds another: a fifth of the full search's cost.
    storages = [leaf.untyped_storage().data_ptr() for leaf in leaves if _aliasable(leaf)]
    if len(set(storages)) == len(storages):
        return {}
    return _search(leaves, requires)


def _search(leaves: Sequence[Any], requires: Sequence[bool]) -> dict[int, int]:
    """:func:`bases_among` by comparing the leaves within each memory: its answer for any leaves
    (with distinct storages, ``{}``: no two share a memory)."""
    # Leaves can only alias within one memory: the same storage, device, dtype, and need for a
    # gradient; and read alike (``x.conj()`` is the same memory, other values).
    memory = {p: (leaf.untyped_storage().data_ptr(), leaf.device, leaf.dtype, leaf.is_conj(), leaf.is_neg(),
                  requires[p])
              for p, leaf in enumerate(leaves) if _aliasable(leaf)}
    roots: list[int] = []
    found: dict[int, int] = {}
    for p, key in memory.items():
        alike = [r for r in roots if memory[r] == key]
        holder = next((r for r in alike if _holds(leaves[r], leaves[p])), None)
        if holder is not None:
            found[p] = holder
            continue
        # A later leaf may hold earlier ones (``(x[:, :2], x)``): it becomes their base, and their views'.
        held = [r for r in alike if _holds(leaves[p], leaves[r])]
        roots = [r for r in roots if r not in held] + [p]
        found = {q: p if b in held else b for q, b in found.items()} | dict.fromkeys(held, p)
    return found


def _aliasable(leaf: Any) -> bool:
    # Plain strided tensors only: a subclass's or a sparse tensor's memory is not its storage's extent.
    return type(leaf) is torch.Tensor and leaf.layout == torch.strided and leaf.numel() > 0


def _holds(base: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether every element of ``other``, a tensor in the same memory, is one of ``base``'s: the
    same layout, or within the extent of a base that covers its extent (strides are never negative)."""
    if _same_layout(other, base):
        return True
    first, end = _extent(base)
    other_first, other_end = _extent(other)
    return _dense(base) and first <= other_first and other_end <= end


def _extent(t: torch.Tensor) -> tuple[int, int]:
    first = t.storage_offset()
    return first, first + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` holds each element of its extent once: a contiguous tensor, its dims perhaps permuted."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t.shape == base.shape and t.stride() == base.stride() and t.storage_offset() == base.storage_offset()
