"""The plan of an ``OffloadOptimizer``: which inner optimizer steps which parameters, one per slice
in slice order and one for the parameters outside the model. What it does not hold: running a
slice's update (``offload/tiers/slice_update.py``) or who owns what across ranks (``sharding.py``,
which the plan asks)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator, MutableMapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..tiers.slice_update import InnerOptimizer, SliceStep, StateByProxy, state_box, unwrapped_optimizer
from ..walk.engine import Engine
from .let_go import let_go_name
from .sharding import Item, Sharding

#: Builds an inner optimizer over parameters, each in the settings of its user group.
MakeInner = Callable[[list[torch.Tensor], list[int]], InnerOptimizer]


def plan_key(param_groups: list[dict[str, Any]], engine: Engine) -> tuple[Any, ...]:
    """What a plan depends on: the groups' parameters and every slice's host copies, by identity."""
    return (tuple(tuple(map(id, group["params"])) for group in param_groups),
            tuple(tuple(id(e.tensor) for e in s.storage.held) for s in engine.slices))


def slice_steps(param_groups: list[dict[str, Any]], engine: Engine, sharding: Sharding | None, inner: MakeInner,
                state: dict[Any, Any]) -> tuple[list[SliceStep], list[SliceStep]]:
    """The steps of the model's slices, in slice order, and the step of the parameters outside the
    model (none or one). Sharded, each slice's step updates this rank's parameters only, and
    ``state`` loses the other ranks' (:meth:`Sharding.assign`)."""
    ordered, rest = _by_slice(param_groups, engine)
    _refuse_let_go(engine, [p for p, _ in rest])
    if sharding is not None:
        ordered = sharding.assign(ordered, state)
    steps = []
    for index, items in ordered.items():
        storage = engine.slices[index].storage
        if not items:
            steps.append(SliceStep(index, storage, None, writes_shadow=False))
            continue
        whole = inner([p for _, p, _ in items], [g for _, _, g in items])
        # Sharded, the shadow is written once every rank's part of the slice has arrived.
        steps.append(SliceStep(index, storage, whole, writes_shadow=sharding is None))
    outside = [SliceStep(-1, None, inner([p for p, _ in rest], [g for _, g in rest]))] if rest else []
    return steps, outside


def inner_optimizer(optimizer: Any, params: list[torch.Tensor], groups: list[int]) -> InnerOptimizer:
    """An inner optimizer of ``optimizer`` (an ``OffloadOptimizer``) over proxies of ``params``, each
    in its user group's settings (``groups``: each parameter's group number)."""
    proxies = [nn.Parameter(p.data, requires_grad=p.requires_grad) for p in params]
    by_group: dict[int, list[nn.Parameter]] = {}
    for proxy, g in zip(proxies, groups):
        by_group.setdefault(g, []).append(proxy)
    inner_groups = [{**snapshot(optimizer.param_groups[g]), "params": members} for g, members in by_group.items()]
    inner = optimizer.optimizer_class(inner_groups, **optimizer.optimizer_kwargs)
    inner._offload_inner = True
    inner.state = StateByProxy(state_box(optimizer), dict(zip(proxies, params)))  # Note: [What an update holds]
    _translate_bnb_overrides(inner, optimizer, proxies, params)
    return InnerOptimizer(inner, proxies, params, list(by_group))


def as_class_adds(optimizer: Any, param_group: Any) -> Any:
    """``param_group`` as ``optimizer.optimizer_class``'s own ``add_param_group()`` leaves it, for
    ``optimizer`` (an ``OffloadOptimizer``) to add: a class may override it (torchao's low-bit
    AdamW turns the group's ``lr`` into a tensor, which its step requires), and the
    OffloadOptimizer, not an instance of the class, can only call ``torch.optim``'s. A throwaway
    instance of the class over the one group runs the override, as ``OffloadOptimizer.__init__``
    has the class fill in its groups: ``torch.optim`` adds the group's dict itself, so the group
    comes back the same dict, over the same tensors (an iterator of them read into a list, as
    ``torch.optim`` reads it), its defaults filled in from the same arguments; what the class
    refuses raises here, before anything is added. Left as it is: a group the class adds as
    ``torch.optim`` does, one added while the OffloadOptimizer is built (the class built it), and
    one that is no dict (``torch.optim``'s error says so; the class would take it for parameters)."""
    optimizer_class = unwrapped_optimizer(optimizer).__dict__.get("optimizer_class")  # through Fabric's wrapper too
    if (optimizer_class is None or optimizer_class.add_param_group is torch.optim.Optimizer.add_param_group
            or not isinstance(param_group, dict)):
        return param_group
    probe = optimizer_class([param_group], **optimizer.optimizer_kwargs)
    return probe.param_groups[0]


def snapshot(group: dict[str, Any]) -> dict[str, Any]:
    """A group's hyperparameters as they are now: tensors copied, those in a tuple or list too
    (``betas=(torch.tensor(0.9), ...)``), since schedulers and compiled steps change them in place."""
    return {k: tree_map(_copied, v) for k, v in group.items() if k != "params"}


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else copy.copy(value)


def _by_slice(param_groups: list[dict[str, Any]],
              engine: Engine) -> tuple[dict[int, list[Item]], list[tuple[torch.Tensor, int]]]:
    """Each slice's parameters in memory order, slices in order; and the parameters outside the model."""
    # A tied parameter is stepped once, with the slice that holds it (its first): later slices
    # that borrow it load it after that slice's update (Note: [Tied parameters across slices]).
    place = {id(e.tensor): (s.index, k) for s in engine.slices for k, e in enumerate(s.storage.held)
             if e.is_parameter}
    per_slice: dict[int, list[Item]] = {}
    rest: list[tuple[torch.Tensor, int]] = []
    for g, group in enumerate(param_groups):
        for p in group["params"]:
            if id(p) in place:
                index, k = place[id(p)]
                per_slice.setdefault(index, []).append((k, p, g))
            else:
                rest.append((p, g))
    return {index: sorted(per_slice[index], key=lambda item: item[0]) for index in sorted(per_slice)}, rest


def _refuse_let_go(engine: Engine, outside: list[torch.Tensor]) -> None:
    """Refuse to step a parameter the model let go of after the optimizer was built (Note:
    [Parameters replaced after the optimizer] in ``let_go.py``).

    Raises:
        RuntimeError: one of ``outside`` (the parameters the slices do not hold) was replaced in the model.
    """
    for p in outside:
        name = let_go_name(engine, p)
        if name is not None:
            raise RuntimeError(
                f"the model's parameters changed after this OffloadOptimizer was built: {name} was replaced in the "
                "model (by resize_token_embeddings, set_input_embeddings, set_output_embeddings or tie_weights), and "
                "the optimizer would step the old tensor, which the model no longer holds, and never train the new "
                "one. Build the optimizer after changing the model. With TRL's SFTConfig(chat_template_path=...), "
                "which resizes the embeddings inside SFTTrainer(...): pass optimizers=(None, None) so that the "
                "trainer builds its optimizer after, or call trl.clone_chat_template(model, tokenizer, path) "
                "yourself, leave chat_template_path unset, and build the optimizer after it")


def _translate_bnb_overrides(inner: Any, outer: Any, proxies: list[nn.Parameter], params: list[torch.Tensor]) -> None:
    """Point a bitsandbytes inner optimizer at the user's overrides (Note: [bitsandbytes overrides])."""
    optim = sys.modules.get("bitsandbytes.optim.optimizer")
    if optim is None or not isinstance(inner, optim.Optimizer8bit):
        return
    position = {id(p): (g, k) for g, group in enumerate(outer.param_groups) for k, p in enumerate(group["params"])}
    user_of = {id(proxy): p for proxy, p in zip(proxies, params)}
    where = {(gi, pi): position[id(user_of[id(proxy)])]
             for gi, group in enumerate(inner.param_groups) for pi, proxy in enumerate(group["params"])}
    inner.mng = _ManagerByProxy(inner.mng, dict(zip(map(id, params), proxies)), where,
                                {id(proxy): id(p) for proxy, p in zip(proxies, params)})


class _KeysTranslated(MutableMapping[Any, Any]):
    """One of bitsandbytes' global tables, read and written under the user's keys for an inner
    optimizer's keys; keys the inner optimizer has no translation for are not in it."""

    def __init__(self, table: dict[Any, Any], translate: dict[Any, Any]) -> None:
        self.table = table
        self.translate = translate

    def __getitem__(self, key: Any) -> Any:
        return self.table[self.translate[key]]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.table[self.translate[key]] = value

    def __delitem__(self, key: Any) -> None:
        del self.table[self.translate[key]]

    def __contains__(self, key: object) -> bool:
        return key in self.translate and self.translate[key] in self.table

    def __iter__(self) -> Iterator[Any]:
        return (key for key, user_key in self.translate.items() if user_key in self.table)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _ManagerByProxy:
    """bitsandbytes' ``GlobalOptimManager`` as an inner optimizer sees it.

    Note: [bitsandbytes overrides]
        bitsandbytes' 8-bit optimizers take per-parameter settings (``optim_bits=32`` for an
        embedding, as ``Trainer`` asks) from one process-wide manager: ``pid2config`` keyed by
        ``id(param)``, ``index2config`` keyed by ``(group index, index in the group)`` in the
        optimizer's own numbering, and module overrides that ``check_overrides`` turns into both
        at the first ``step()``. ``get_config`` reads the two tables at every update. An inner
        optimizer steps proxies, numbered within its slice: read plainly, it would miss every
        override and take the ``index2config`` entries of the user's first parameters (left by
        any earlier optimizer, which the plain optimizer reads at those positions) for the first
        of every slice. So it reads and writes both tables under the user's parameter and the
        user's position, and sees a module override of a parameter it steps as one of its proxy:
        each parameter gets what the plain optimizer gives it, and the tables are left as the
        plain optimizer leaves them.
    """

    def __init__(self, manager: Any, proxy_of: dict[int, nn.Parameter], where: dict[tuple[int, int], tuple[int, int]],
                 user_id: dict[int, int]) -> None:
        self.manager = manager
        self.proxy_of = proxy_of  # id of the user's parameter -> its proxy
        self.pid2config = _KeysTranslated(manager.pid2config, user_id)
        self.index2config = _KeysTranslated(manager.index2config, where)

    @property
    def module_weight_config_triple(self) -> Iterator[tuple[Any, str, dict[str, Any]]]:
        # Read when check_overrides runs, so overrides registered until the first step() count, as they do plainly.
        for module, attr, config in self.manager.module_weight_config_triple:
            proxy = self.proxy_of.get(id(getattr(module, attr)))
            if proxy is not None:
                yield SimpleNamespace(**{attr: proxy}), attr, config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)
