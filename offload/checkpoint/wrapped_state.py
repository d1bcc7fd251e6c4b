"""Optimizer state kept as a tensor subclass that wraps plain tensors, saved as what it holds
(Note: [Wrapped state]).

Note: [Wrapped state]
    Some optimizers keep a state value as a tensor subclass around plain tensors: torchao's
    low-bit AdamW keeps each moment as 8- or 4-bit codes, a scale per block and a code map
    (``OptimState8bit``, ``OptimState4bit``). DCP writes a tensor as the values it stands for: such
    a moment would be saved as float32, 4-8x its bytes, and loaded back as a plain float32 tensor,
    which the optimizer then steps as a float32 moment, silently, with other results. A value that
    flattens (``__tensor_flatten__``, the protocol of PyTorch's traceable wrapper subclasses) is
    saved as what it holds instead:

    ``optim/state/<parameter name>/<key>``
        a description: the class (``module:qualname``), its flatten context, the names of its
        tensors, its size and stride.
    ``optim/wrapped/<parameter name>/<key>/<tensor name>``
        each tensor it holds, as the plain tensor it is.

    Loading reads those tensors into the ones the value the optimizer holds wraps, where the shapes
    and dtypes match (in place, no second copy), and otherwise into new tensors, then builds the
    value again with the class's ``__tensor_unflatten__``, as ``torch.load`` of a ``state_dict()``
    would have given it: a resume is bit for bit the uninterrupted run, into a fresh optimizer
    too. A wrapped value that wraps another is refused at save: no optimizer keeps one.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

CLASS = "offload.wrapped_tensor"  # the key that marks a description, and holds the class


def state_entries(entry: str, value: Any, own_storage: Any) -> dict[str, Any]:
    """The DCP entries of one optimizer state value saved under ``entry``
    (``optim/state/<name>/<key>``); ``own_storage`` gives a tensor the storage DCP writes.

    Raises:
        ValueError: a wrapped value wraps another.
    """
    if not is_traceable_wrapper_subclass(value):
        return {entry: own_storage(value)}
    names, context = value.__tensor_flatten__()
    kind = type(value)
    entries: dict[str, Any] = {entry: {CLASS: f"{kind.__module__}:{kind.__qualname__}", "names": list(names),
                                       "context": context, "size": tuple(value.shape),
                                       "stride": tuple(value.stride())}}
    for name in names:
        inner = getattr(value, name)
        if is_traceable_wrapper_subclass(inner):
            raise ValueError(f"cannot save optimizer state {entry!r}: a {kind.__name__} whose {name!r} is itself a "
                             f"{type(inner).__name__}; save_checkpoint keeps one level of wrapped state")
        entries[_inner_key(entry, name)] = own_storage(inner)
    return entries


def saved_inner(metadata: Metadata) -> dict[str, dict[str, TensorStorageMetadata]]:
    """By ``optim/state/...`` entry, the tensors saved for a wrapped value, by name."""
    inner: dict[str, dict[str, TensorStorageMetadata]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith("optim/wrapped/") and isinstance(entry, TensorStorageMetadata):
            state_key, _, name = key.removeprefix("optim/wrapped/").rpartition("/")
            inner.setdefault(f"optim/state/{state_key}", {})[name] = entry
    return inner


def inner_destinations(entry: str, saved: dict[str, TensorStorageMetadata], held: Any,
                       destination: Any) -> dict[str, Any]:
    """Where DCP loads the tensors saved for the wrapped value ``entry``: those ``held`` wraps
    where ``destination`` finds them fit, else new ones."""
    wraps = is_traceable_wrapper_subclass(held)
    return {_inner_key(entry, name): destination(meta, getattr(held, name, None) if wraps else None)
            for name, meta in saved.items()}


def loaded_value(entry: str, state: dict[str, Any]) -> Any:
    """The value loaded for ``entry``: the plain value, or the wrapped one built again from its
    tensors (Note: [Wrapped state]).

    Raises:
        ValueError: a description whose class cannot be found, or whose tensors are missing.
    """
    value = state[entry]
    if not (isinstance(value, dict) and CLASS in value):
        return value
    module, _, qualname = value[CLASS].partition(":")
    try:
        kind: Any = importlib.import_module(module)
        for part in qualname.split("."):
            kind = getattr(kind, part)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"optimizer state {entry!r} was saved as a {value[CLASS]}, which cannot be imported here "
                         f"({error}): install the library that defines it") from error
    if not (isinstance(kind, type) and issubclass(kind, torch.Tensor) and hasattr(kind, "__tensor_unflatten__")):
        raise ValueError(f"optimizer state {entry!r} was saved as a {value[CLASS]}, which is not a tensor subclass "
                         "that unflattens")
    missing = [name for name in value["names"] if _inner_key(entry, name) not in state]
    if missing:
        raise ValueError(f"optimizer state {entry!r} lacks its tensors {missing}")
    inner = {name: state[_inner_key(entry, name)] for name in value["names"]}
    return kind.__tensor_unflatten__(inner, value["context"], torch.Size(value["size"]), value["stride"])


def _inner_key(entry: str, name: str) -> str:
    return f"optim/wrapped/{entry.removeprefix('optim/state/')}/{name}"
