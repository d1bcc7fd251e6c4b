"""``SettledModule``: an ``nn.Module`` whose reads of its parameters wait for the pending host
updates first (Note: [Overlapped host update] in ``offload/optimizer.py``). What it does not hold:
the updates themselves (``offload/streams/updates.py``) or the model around them
(``offload/model.py``)."""

from __future__ import annotations

from typing import Any

from torch import nn


class SettledModule(nn.Module):
    """The base of ``OffloadModel``: whatever hands out the host copies (``parameters()``,
    ``named_parameters()``, ``modules()``, ``children()``, ``buffers()``, ``apply()``,
    ``state_dict()``, ``load_state_dict()``, submodules by attribute) waits for the pending
    updates of its engine (kept in ``_engine``) first, also when a parent module's
    ``state_dict()`` or ``load_state_dict()`` reaches it. ``train()`` sets flags only and does not
    wait."""

    def _settle(self) -> None:
        engine = self.__dict__.get("_engine")
        if engine is not None and engine.updates.pending():
            engine.updates.wait_all(shadows_stale=True)

    def __getattr__(self, name: str) -> Any:
        if name != "_engine":
            self._settle()  # a submodule, whose parameters the caller may read
        return super().__getattr__(name)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        self._settle()
        return super().named_parameters(*args, **kwargs)

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:
        # modules(), buffers() and apply() come through here: the submodules hold the parameters.
        self._settle()
        return super().named_modules(*args, **kwargs)

    def named_children(self) -> Any:
        self._settle()  # children() comes through here
        return super().named_children()

    def train(self, mode: bool = True) -> SettledModule:
        """Set training mode, as ``nn.Module.train``, without waiting for pending updates: it sets
        flags and reads no parameter (``nn.Module.train`` would ask ``children()``, which waits)."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        for layer in self._modules.values():
            if layer is not None:
                layer.train(mode)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._settle()
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # Here rather than in load_state_dict(): a parent's load_state_dict() walks its submodules
        # through this method, and reaches it before the layers whose parameters it copies into.
        self._settle()
        super()._load_from_state_dict(*args, **kwargs)
