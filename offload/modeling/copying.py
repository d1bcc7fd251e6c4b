"""``CopiedByLayers``: how a model that owns an engine is copied and pickled: by building a new
engine around its layers, cut the same way, never by copying the engine field by field. What it
does not hold: the engine it builds (``offload/walk/engine.py``) or the model's settings and
forward (``offload/model.py``)."""

from __future__ import annotations

import copy
from typing import Any, ClassVar

from torch import nn

from .settled import SettledModule


class CopiedByLayers(SettledModule):
    """The base of ``OffloadModel`` for ``copy.deepcopy``, ``copy.copy`` and pickling
    (``torch.save(model)``). The engine (kept in ``_engine``) holds streams, events, worker threads
    and pinned buffers, which neither copy nor pickle: a deep copy or a loaded pickle gets a new one,
    built by the subclass's ``_adopt`` from its layers and how they were cut. Everything else,
    what was registered on the model itself included (hooks, parameters, buffers, attributes), is
    copied as ``nn.Module`` copies it. A copy is local: it never joins the original's process
    group, so building one needs no other rank."""

    #: The attributes a deep copy shares with the original rather than copies (settings, and a
    #: ``DiskTier`` whose files are not the copy's to duplicate): the subclass's. Every other
    #: attribute but the engine is copied.
    _copied_settings: ClassVar[tuple[str, ...]] = ("training",)
    #: Attributes a pickle from an older version lacks, with the value that version behaved as.
    _pickled_before: ClassVar[dict[str, Any]] = {}
    _engine: Any  # the subclass's engine, built by _adopt

    def _adopt(self, named_groups: list[tuple[list[str], list[nn.Module]]]) -> None:
        raise NotImplementedError  # the subclass builds its engine

    def __deepcopy__(self, memo: dict[int, Any]) -> CopiedByLayers:
        # Everything but the engine is copied as nn.Module's deep copy would (what was registered
        # on the model itself too: hooks, parameters, buffers, plain attributes), in one pass, so a
        # tensor both a layer and the model hold stays one tensor; settings are taken as they are.
        self._settle()
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        kept = {name: self.__dict__[name] for name in self._copied_settings if name in self.__dict__}
        # nn.Module's own state: without a compiled call (model.compile()), which would run the original.
        state = {name: value for name, value in nn.Module.__getstate__(self).items()
                 if name not in kept and name != "_engine"}
        state["_data_parallel"] = None  # a copy is local: building one must not need the other ranks
        twin.__dict__.update(copy.deepcopy(state, memo), **kept)
        twin._adopt([(list(s.names), [twin._modules[name] for name in s.names]) for s in self._engine.slices])
        return twin

    def __getstate__(self) -> dict[str, Any]:
        # Keep the layers, the settings and how the layers were cut; __setstate__ builds the engine.
        self._settle()
        state = nn.Module.__getstate__(self)  # a copy of __dict__ without a compiled call (model.compile())
        state["_slice_names"] = [list(s.names) for s in state.pop("_engine").slices]
        state["_data_parallel"] = None  # a loaded model is local, as a deep copy is
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        names = state.pop("_slice_names")
        for name, value in self._pickled_before.items():
            state.setdefault(name, value)
        super().__setstate__(state)
        self._adopt([(list(group), [self._modules[name] for name in group]) for group in names])

    def __copy__(self) -> CopiedByLayers:
        # A shallow copy shares the engine, as nn.Module's default copy shares everything; going
        # through __getstate__ would build a second engine over the same parameters.
        twin = type(self).__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin
