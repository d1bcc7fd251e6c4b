"""Running the user's own modules on device copies of their tensors.

A slice runs its layers unchanged; for the duration of the call each registration site of a
parameter or buffer (``module._parameters[name]`` / ``module._buffers[name]``) holds the device copy
instead of the host copy, and gets the host copy back afterwards, also when the layer raises. The
same mechanism as :func:`torch.func.functional_call`, without its per-call name resolution.

Note: [Parametrizations cached around a run]
    Inside ``torch.nn.utils.parametrize.cached()`` a parametrized tensor is computed once per
    module and reused, keyed by the module alone. A run binds new device copies each time, so an
    entry cached by an earlier run (or outside the model, from the host copies) is a tensor of
    other leaves: a recompute that took it would differentiate the forward's discarded graph,
    not its own, and the parametrization's ``original`` would get no gradient. So while the
    caller's cache is on, each binding gets a cache of its own for its duration: the layers still
    cache (a weight used twice in one run is computed once, as in the plain model), and the
    caller's entries are back untouched afterwards. Each run computes the parametrization again,
    which the caller's cache would have shared between runs: the forward refuses the cases where
    that sharing changes a gradient (rule 4 of Note: [Transforms the walk refuses] in
    ``offload/autograd/refusals.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..streams.quantized import restore_run_states, swap_run_states
from ..streams.sites import Site


@dataclass
class Binding:
    """Context manager that puts ``tensors[i]`` at every site in ``sites[i]``, and swaps in the
    run state of each 8-bit layer at ``run_state_positions`` (the slice's
    ``SliceStorage.run_state_positions``; Note: [Quantized weights], rule 6).

    After the call, :attr:`reassigned` lists ``(i, new_tensor)`` for buffers a module replaced
    during the call (``self.count = self.count + 1``); the caller decides what to keep of them.

    Leaving always gives every site its host copy back, registered as it was (a parameter in
    ``_parameters``, never left behind as a buffer), also when the call raised or moved a tensor
    between the tables: the user's modules are never left changed by a failed run.

    Raises:
        RuntimeError: a layer left a parametrization registered on one of its parameters
            (``register_parametrization`` in forward without ``remove_parametrizations``); the
            parametrization is removed first.
    """

    sites: Sequence[Sequence[Site]]
    tensors: Sequence[torch.Tensor]
    run_state_positions: Sequence[int]
    reassigned: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    _originals: list[tuple[Site, torch.Tensor | None]] = field(default_factory=list)
    _run_states: list[tuple[nn.Module, object]] = field(default_factory=list)
    _caller_cache: dict[object, torch.Tensor] | None = None

    def __enter__(self) -> Binding:
        # Note: [Parametrizations cached around a run]
        if parametrize._cache_enabled:
            self._caller_cache, parametrize._cache = parametrize._cache, {}
        for entry_sites, tensor in zip(self.sites, self.tensors):
            for site in entry_sites:
                table = site.table()
                self._originals.append((site, table[site.name]))
                table[site.name] = tensor
        _refresh_flat_weights(self.sites)
        # An 8-bit layer reads its codes from its own state: Note: [Quantized weights], rule 6.
        # Which entries are 8-bit weights is known from the slice's layout, so a slice without
        # one binds without looking at any entry for a state: every load, forward and backward.
        self._run_states = swap_run_states(self.sites, self.tensors, self.run_state_positions)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        left_parametrized: list[Site] = []
        try:
            if exc_type is None:
                for index, (entry_sites, tensor) in enumerate(zip(self.sites, self.tensors)):
                    if not entry_sites:
                        continue  # a quantisation state's tensor, registered nowhere
                    current = entry_sites[0].table().get(entry_sites[0].name)
                    if current is not tensor and current is not None and not entry_sites[0].is_parameter:
                        self.reassigned.append((index, current))
        finally:
            if self._caller_cache is not None:
                parametrize._cache, self._caller_cache = self._caller_cache, None
            restore_run_states(self._run_states)
            self._run_states = []
            for site, original in reversed(self._originals):
                if _restore(site, original):
                    left_parametrized.append(site)
            self._originals.clear()
            _refresh_flat_weights(self.sites)
        if left_parametrized and exc_type is None:
            names = ", ".join(f"{type(site.module).__name__}.{site.name}" for site in left_parametrized)
            raise RuntimeError(
                f"a layer registered a parametrization on {names} during forward and left it there. OffloadModel "
                "runs layers on device copies of their parameters and gives the host copies back after each run, "
                "so a parametrization must be gone when forward returns (remove_parametrizations in the same "
                "forward, as PEFT does), or registered before the model is wrapped in OffloadModel, where it is "
                "offloaded like any layer."
            )


def _restore(site: Site, original: torch.Tensor | None) -> bool:
    """Register ``original`` at ``site`` again, exactly as it was registered before the call.

    Returns whether a parametrization the call registered there had to be removed first.
    """
    module = site.module
    removed = False
    if site.name not in site.table() and parametrize.is_parametrized(module, site.name):
        # The device copy becomes the plain tensor again, and is then replaced by the host copy.
        parametrize.remove_parametrizations(module, site.name, leave_parametrized=False)
        removed = True
    # A tensor re-registered in the other table (a parameter put back as a buffer) leaves it.
    other = module._buffers if site.is_parameter else module._parameters
    if site.name in other:
        del other[site.name]
        if site.is_parameter:
            module._non_persistent_buffers_set.discard(site.name)
    site.table()[site.name] = original
    return removed


def _refresh_flat_weights(sites: Sequence[Sequence[Site]]) -> None:
    # Recurrent layers (nn.LSTM, nn.GRU, nn.RNN) keep a list of their weights next to _parameters
    # and read that list in forward; rebuild it so it follows the swap.
    refreshed: set[int] = set()
    for entry_sites in sites:
        for site in entry_sites:
            module = site.module
            if isinstance(module, nn.RNNBase) and id(module) not in refreshed:
                refreshed.add(id(module))
                module._flat_weights = [
                    getattr(module, name) if hasattr(module, name) else None
                    for name in module._flat_weights_names
                ]
