"""A model input, a boundary activation or a model output taken apart into leaves and put back
together: torch's pytree, opened further into the containers it keeps whole.

Nothing here moves data or reads a tensor's values.

Note: [Containers pytree keeps whole]
    ``torch.utils._pytree`` flattens tuples, lists, dicts, namedtuples and the types registered
    with it (Hugging Face's ``ModelOutput`` registers itself); any other object is one leaf,
    whole. A tensor inside a dataclass, a dict or list subclass (``class Features(OrderedDict)``)
    or a ``UserDict`` would then be none of the walk's leaves: no input of the autograd Function,
    so the caller's tensor got no gradient, silently; inside a boundary activation or the output,
    it kept the graph of the slice that made it, which backward then met outside the walk.

    1. Such a container is opened where it holds a tensor, at any depth: a dataclass by its
       attributes (its fields, and any other it holds), a mutable mapping (a dict subclass,
       ``UserDict``) by its keys in order, a mutable sequence (a list subclass, ``UserList``) by
       position. What it holds is flattened in turn, as the plain model would reach it. One that
       holds no tensor stays a leaf, as before (``torch.Size``, a configuration object).
    2. It is put back together as the same type: a shallow copy of the container, made when it
       was opened and emptied of its items (so the structure keeps no tensor alive), given the
       items again; the mapping through its own ``__setitem__``, a dataclass through
       ``object.__setattr__`` (a frozen one too). Its other attributes carry over (a
       ``defaultdict``'s factory); ``__init__`` and ``__post_init__`` do not run again. Each
       boundary gets a new object, as for a plain dict.
    3. A container of another kind that holds a tensor is refused, before anything runs where it
       is the model's input: a tuple subclass that is no namedtuple, a read-only mapping, or a
       mapping or sequence subclass holding a tensor in an attribute besides its items. Nothing
       can put a tensor back into those without running user code that the plain model never
       ran; the message says to use a tuple, dict or namedtuple, or to register the type with
       ``torch.utils._pytree``.
    4. The usual structure (tuples, dicts, tensors) costs one pass of ``tree_flatten`` and a type
       check a leaf: a second pass runs only where a container is opened.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import UserList
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, register_pytree_node, tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = ["flatten", "map_tensors", "tensors_in", "unflatten"]


def flatten(value: Any, where: str) -> tuple[list[Any], TreeSpec]:
    """``value``'s leaves and structure, containers that hold a tensor opened (Note: [Containers
    pytree keeps whole]); :func:`unflatten` puts them back. ``where``: what ``value`` is, for the
    refusal ("the model's input").

    Raises:
        TypeError: a container that cannot be put back together holds a tensor (rule 3).
    """
    leaves, spec = tree_flatten(value)
    if not any(_opens(leaf, where) for leaf in leaves if not isinstance(leaf, torch.Tensor)):
        return leaves, spec
    return tree_flatten(tree_map(lambda leaf: _opened(leaf, where), value))


def unflatten(leaves: list[Any], spec: TreeSpec) -> Any:
    """The structure :func:`flatten` took apart, around ``leaves``."""
    return tree_unflatten(leaves, spec)


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any, where: str) -> Any:
    """``value`` with ``fn(t)`` in place of each tensor ``t`` among :func:`flatten`'s leaves; ``value``
    itself, nothing put back together, where ``fn`` gives every tensor back as it is.

    Raises:
        TypeError: as :func:`flatten`.
    """
    leaves, spec = flatten(value, where)
    mapped = [fn(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    if all(new is old for new, old in zip(mapped, leaves)):
        return value
    return unflatten(mapped, spec)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors among ``value``'s leaves, in :func:`flatten`'s order, a container opened wherever
    it holds one, even one rule 3 refuses: for counting what a value holds (the planner's bytes of
    an input or a layer's output, where a layer inside a slice may return any container), which
    puts nothing back together and so refuses nothing."""
    found = []
    for leaf in tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif (opened := _items(leaf)) is not None:
            found.extend(tensors_in(opened[0]))
    return found


@dataclasses.dataclass(frozen=True)
class _Shape:
    """How to put an opened container back together: its type, its keys (attribute names, mapping
    keys, or ``None`` for a sequence) and the emptied copy to fill (rule 2). Two shapes are alike
    by type and keys."""

    kind: type
    keys: tuple[Any, ...] | None
    empty: Any = dataclasses.field(compare=False)


class _Opened:
    """An opened container inside the tree that pytree flattens: its items, and its shape."""

    def __init__(self, items: list[Any], shape: _Shape) -> None:
        self.items = items
        self.shape = shape


def _rebuilt(items: Any, shape: _Shape) -> Any:
    """The container again, the items in their places (rule 2)."""
    container = copy.copy(shape.empty)
    items = list(items)
    if shape.keys is None:
        container.extend(items)
    elif isinstance(container, MutableMapping):
        for key, item in zip(shape.keys, items):
            container[key] = item
    else:
        for name, item in zip(shape.keys, items):
            object.__setattr__(container, name, item)
    return container


register_pytree_node(_Opened, lambda opened: (opened.items, opened.shape), _rebuilt)


def _items(leaf: Any) -> tuple[list[Any], tuple[Any, ...] | None] | None:
    """What a pytree leaf holds and its keys, where rule 1 opens it; else ``None``."""
    if isinstance(leaf, (str, bytes, type)):
        return None
    if isinstance(leaf, Mapping):
        keys = tuple(leaf.keys())
        return [leaf[k] for k in keys], keys
    if isinstance(leaf, (list, tuple, UserList)):
        return list(leaf), None
    if dataclasses.is_dataclass(leaf):
        names = tuple(vars(leaf)) if hasattr(leaf, "__dict__") else tuple(
            f.name for f in dataclasses.fields(leaf) if hasattr(leaf, f.name))
        return [getattr(leaf, name) for name in names], names
    return None


def _holds_tensor(values: Any, where: str) -> bool:
    return any(isinstance(x, torch.Tensor) or _opens(x, where) for x in tree_leaves(values))


def _opens(leaf: Any, where: str) -> bool:
    """Whether rule 1 opens pytree leaf ``leaf``: a container that holds a tensor."""
    found = _items(leaf)
    if found is None or not _holds_tensor(found[0], where):
        return False
    if not isinstance(leaf, (MutableMapping, MutableSequence)) and not dataclasses.is_dataclass(leaf):
        _refuse(leaf, where, "among the items of")
    return True


def _opened(leaf: Any, where: str) -> Any:
    """``leaf`` opened where rule 1 says so, what it holds opened in turn; else ``leaf``."""
    if isinstance(leaf, torch.Tensor) or not _opens(leaf, where):
        return leaf
    items, keys = _items(leaf)  # type: ignore[misc]  # _opens found them
    empty = copy.copy(leaf)
    if isinstance(leaf, (MutableMapping, MutableSequence)):
        empty.clear()
        if _holds_tensor(list(getattr(empty, "__dict__", {}).values()), where):
            _refuse(leaf, where, "in an attribute, besides the items, of")
    else:
        for name in keys:  # type: ignore[union-attr]  # a dataclass's attribute names
            object.__setattr__(empty, name, None)
    return _Opened([tree_map(lambda x: _opened(x, where), item) for item in items], _Shape(type(leaf), keys, empty))


def _refuse(leaf: Any, where: str, part: str) -> None:
    kind = type(leaf).__qualname__
    raise TypeError(
        f"OffloadModel: {where} holds a tensor {part} a {kind}, which OffloadModel cannot put back "
        "together after taking the tensor out (Note: [Containers pytree keeps whole] in offload/walk/"
        "structures.py), so the tensor would get no gradient and would not reach the device. Pass the tensors "
        "in a tuple, list, dict, namedtuple or dataclass, or register the type with torch.utils._pytree "
        "(register_pytree_node, or register_dataclass for a dataclass) so that its tensors are seen")
