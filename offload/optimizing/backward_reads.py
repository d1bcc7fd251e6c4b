"""What the updates that a backward starts read (Note: [Update in backward] in ``in_backward.py``):
the hyperparameters and the optimizer's state as that backward starts, and each ``.grad`` as it
ends; kept until ``step()``, which compares them with what it would read itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from .plan import snapshot


@dataclass
class BackwardReads:
    """What the updates started by one backward read.

    Attributes:
        hyper: each parameter group's hyperparameters as the backward started (``snapshot``).
        state: the optimizer's state dict then: ``load_state_dict()`` replaces it, and the updates
            already started stepped the one it replaced.
        seen: each of the model's parameters with its ``.grad`` and that tensor's version as the
            backward ended.
    """

    hyper: list[dict[str, Any]]
    state: Any
    seen: list[tuple[torch.Tensor, torch.Tensor | None, int]] = field(default_factory=list)

    @classmethod
    def at_start(cls, optimizer: Any) -> BackwardReads:
        return cls([snapshot(group) for group in optimizer.param_groups], optimizer.__dict__.get("state"))

    def at_end(self, optimizer: Any, inside: set[int]) -> None:
        """Remember each ``.grad`` of the model's parameters (ids ``inside``): ``step()`` steps the
        others with the ``.grad`` they hold then, so changing theirs (clipping a head outside the
        model) is as without the option."""
        self.seen = [(p, p.grad, p.grad._version if p.grad is not None else 0)
                     for group in optimizer.param_groups for p in group["params"] if id(p) in inside]

    def difference(self, optimizer: Any, inside: set[int], name: Callable[[torch.Tensor], str]
                   ) -> tuple[str, str] | None:
        """What ``step()`` would read that these updates did not, and what to do instead; ``None``
        if nothing. A ``.grad`` changed in place through PyTorch's operations moves its version
        counter; one replaced is another tensor."""
        changed = [name(p) for p, grad, version in self.seen
                   if p.grad is not grad or (grad is not None and grad._version != version)]
        if self.state is not None and optimizer is not None and optimizer.__dict__.get("state") is not self.state:
            return ("load_state_dict() between backward and step(); the updates backward started stepped the "
                    "state it replaced.", "Load the optimizer's state before backward or after step(), or build "
                    "OffloadOptimizer without update_in_backward.")
        if changed:
            return (f"the gradient of {listing(changed)} changed between backward and step() (clip_grad_norm_, a "
                    "hook, zero_grad).", "Build OffloadOptimizer without update_in_backward to change gradients "
                    "before the update.")
        moved = _moved(self.hyper, optimizer, inside)
        if moved:
            return (f"{listing(moved)} changed between backward and step(); the update reads the hyperparameters "
                    "backward saw.", "Change them before backward or after step() (a scheduler steps after "
                    "optimizer.step()), or build OffloadOptimizer without update_in_backward.")
        return None


def _moved(before: list[dict[str, Any]], optimizer: Any, inside: set[int]) -> list[str]:
    """The hyperparameters whose values differ from ``before`` (``snapshot`` of each group), by
    name, in the groups holding a parameter of the model (ids ``inside``): step() steps the others
    with what they hold then."""
    if optimizer is None:
        return []
    groups = optimizer.param_groups
    if len(groups) != len(before):
        return ["the parameter groups"]
    moved = []
    for g, (old, group) in enumerate(zip(before, groups)):
        if not any(id(p) in inside for p in group["params"]):
            continue
        for key in old.keys() | (group.keys() - {"params"}):
            if not _same(old.get(key), group.get(key)):
                moved.append(f"'{key}' of group {g}")
    return sorted(moved)


def _same(a: Any, b: Any) -> bool:
    """Whether two hyperparameters hold the same values, tensors in a tuple or list (betas) included."""
    a_leaves, a_spec = tree_flatten(a)
    b_leaves, b_spec = tree_flatten(b)
    if a_spec != b_spec:
        return False
    for x, y in zip(a_leaves, b_leaves):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def listing(names: list[str]) -> str:
    """The first of ``names``, and how many more."""
    return names[0] if len(names) == 1 else f"{names[0]} (and {len(names) - 1} more)"
