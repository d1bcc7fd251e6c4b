"""One call's structure across the autograd Function's boundary.

``autograd.Function.apply`` takes and returns flat tensors; a model input or output is any nested
structure (tensor, tuple, list, dict) with values that are not tensors among its leaves. A
:class:`Call` takes the input apart on the model's side, puts it back together inside the
Function's forward, and does the same for the output on the way back: one owner for both ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten


def flatten_input(value: Any, compute_dtype: torch.dtype | None) -> tuple[list[Any], TreeSpec]:
    """The model input's leaves, floating-point tensors cast to ``compute_dtype`` if one is given.

    Cast here, outside the Function, so that autograd casts the input gradient back to the
    input's dtype.
    """
    leaves, spec = tree_flatten(value)
    if compute_dtype is not None:
        leaves = [x.to(compute_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                  for x in leaves]
    return leaves, spec


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
    output_tensor_positions: list[int] = field(default_factory=list)

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

    def returning(self, leaves: Sequence[Any], spec: TreeSpec) -> tuple[torch.Tensor, ...]:
        """Remember the output's structure; the tensors among its ``leaves`` are the Function's results."""
        self.output_spec = spec
        self.output_tensor_positions = [p for p, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.output_leaves = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return tuple(leaves[p] for p in self.output_tensor_positions)

    def output_with(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The output structure around the tensors autograd returned from the Function."""
        leaves = list(self.output_leaves)
        for position, tensor in zip(self.output_tensor_positions, tensors):
            leaves[position] = tensor
        assert self.output_spec is not None, "the Function's forward sets the output structure"
        return tree_unflatten(leaves, self.output_spec)
