"""``FixedStructure``: an ``OffloadModel``'s top-level layers as ``nn.Sequential`` offers them, read
only (``model[3]``, ``model[1:3]``, ``len(model)``, iteration), and the refusal of what would change
them, or their host copies' layout, behind the engine's back (Note: [Layers fixed at wrapping]).
What it does not hold: following changes *inside* a layer (a submodule or parameter replaced),
which the engine does before every forward (``Engine.refresh`` in ``offload/walk/engine.py``)."""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from torch import nn

from .settled import SettledModule

# Note: [Layers fixed at wrapping]
#     1. The engine cuts the top-level layers into slices when the model is built, and forward runs
#        the slices' layers. A top-level layer set (``model.head = ...``, ``setattr(model, "5",
#        ...)``), added (``add_module``, ``register_module``) or deleted (``delattr``) afterwards
#        would show in ``parameters()`` and ``state_dict()`` but not in forward: an optimizer would
#        train tensors forward never uses. So each is refused where it is made, and a change written
#        into ``_modules`` directly (``torch.ao.quantization.convert`` does) at the next forward.
#     2. Re-slicing in place is not offered: where a new layer goes, how the slices are balanced,
#        what an optimizer stepping the old slices does, have no one answer. Building the wanted
#        ``nn.Sequential`` and wrapping it again answers them all, as the error says.
#     3. Registering the very module a name holds already is no change, and is let through: a move
#        (``.to(device)``) and a loaded pickle register the layers again when they build an engine.
#     4. Inside a layer anything may change (a submodule replaced, an adapter injected, a parameter
#        assigned): the engine lays a slice out again when its layers register other tensors.
#     5. ``share_memory()`` would move each host copy out of its slice's flat buffer; the next
#        forward lays the slice out again in unshared (pinned) memory, so nothing would stay shared.
#        It is refused. A process that trains a copy (Hogwild) could not reach the parent anyway.

_WHAT_TO_DO = (
    "OffloadModel cut its layers into slices when it was built, and its forward runs those: {what} would change what "
    "parameters() and state_dict() show, not what forward runs. Change the nn.Sequential before wrapping it, or build the one you "
    "want (this model's layers are model[0], model[1], ...; model.partition names them) and wrap it again: "
    "OffloadModel(nn.Sequential(...), device=...), with an optimizer over its parameters. Changes inside a layer "
    "(model[k].proj = nn.Linear(...)) are followed")


def layers_fixed_error(what: str) -> RuntimeError:
    """The refusal of a change to the top-level layers (Note: [Layers fixed at wrapping]): ``what``
    names the change ("setting layer '5'")."""
    return RuntimeError(_WHAT_TO_DO.format(what=what))


def check_layers_unchanged(modules: dict[str, nn.Module | None], slices: Sequence[Any]) -> None:
    """Refuse a forward whose model holds other top-level layers than the engine's ``slices`` run
    (Note: [Layers fixed at wrapping], rule 1: a change written into ``_modules`` directly).

    Raises:
        RuntimeError: a layer was set, added or deleted; the message says what to do instead.
    """
    expected = [(name, layer) for s in slices for name, layer in zip(s.names, s.layers)]
    if len(modules) == len(expected) and all(modules.get(name) is layer for name, layer in expected):
        return  # the common case, checked every forward
    changed = [name for name, layer in expected if modules.get(name) is not layer]
    changed += [name for name in modules if name not in dict(expected)]
    raise layers_fixed_error(f"changing layer(s) {', '.join(repr(n) for n in changed)} in model._modules")


class FixedStructure(SettledModule):
    """The base of ``OffloadModel`` for its top-level layers: read as ``nn.Sequential`` reads them,
    never changed once the engine (kept in ``_engine``) has cut them into slices (Note: [Layers
    fixed at wrapping]). Before that (while a copy or a loaded pickle builds its engine) layers are
    registered as in any module.

    Example::

        >>> model[0], model[-1], len(model), list(model)   # the layers, in order
        >>> model[1:3]                                    # an nn.Sequential over the same layers
        >>> model[0].proj = nn.Linear(8, 8)               # inside a layer: followed
        >>> model.head = nn.Linear(8, 2)                  # RuntimeError: the layers are fixed
    """

    # -- reading the layers, as nn.Sequential does -----------------------------------------------

    def __getitem__(self, idx: int | slice) -> nn.Module:
        """The layer at ``idx`` (negative counts from the end), or, for a slice, a plain
        ``nn.Sequential`` over the same layer objects under their names: it runs where their host
        copies are, not offloaded (wrap it again only in place of this model: Note: [Layers fixed
        at wrapping], rule 2).

        Raises:
            IndexError: ``idx`` is out of range.
            TypeError: ``idx`` is neither an integer nor a slice.
        """
        self._settle()  # the caller may read the layer's parameters
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        layers = list(self._modules.values())
        index = operator.index(idx)
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"index {idx} is out of range for an OffloadModel of {len(layers)} layers")
        return layers[index]  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        self._settle()
        return iter(list(self._modules.values()))  # type: ignore[arg-type]

    # -- refusing changes to them ---------------------------------------------------------------

    def __setitem__(self, idx: int | slice, module: Any) -> None:
        raise layers_fixed_error(f"setting model[{idx!r}]")

    def __delitem__(self, idx: int | slice) -> None:
        raise layers_fixed_error(f"deleting model[{idx!r}]")

    def __setattr__(self, name: str, value: Any) -> None:
        modules = self.__dict__.get("_modules")
        if "_engine" in self.__dict__ and modules is not None:
            if name in modules and value is not modules[name]:
                raise layers_fixed_error(f"setting layer {name!r}")
            if name not in modules and isinstance(value, nn.Module):
                raise layers_fixed_error(f"adding layer {name!r} (nn.Sequential runs every module it holds)")
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if "_engine" in self.__dict__ and name in self._modules:
            raise layers_fixed_error(f"deleting layer {name!r}")
        super().__delattr__(name)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        # register_module() comes through here; __setattr__ does not.
        if "_engine" in self.__dict__ and (name not in self._modules or self._modules[name] is not module):
            raise layers_fixed_error(f"{'setting' if name in self._modules else 'adding'} layer {name!r}")
        super().add_module(name, module)

    def share_memory(self) -> FixedStructure:
        """Refused (Note: [Layers fixed at wrapping], rule 5).

        Raises:
            RuntimeError: always; the message says what to do instead.
        """
        raise RuntimeError(
            "OffloadModel keeps its host copies in one (pinned) buffer a slice, which share_memory() cannot put in "
            "shared memory: each would be laid out again, unshared, at the next forward, and a process training "
            "this model (Hogwild) would never reach this one. Train in one process, or over several with "
            "OffloadModel(..., process_group=...) (docs/distributed.md); to share a model between processes, "
            "share the plain nn.Sequential")
