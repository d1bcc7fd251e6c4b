"""State a layer keeps outside its parameters and buffers, and how a recompute sees it as forward did.

Note: [Attribute state]
    A recompute reproduces a slice's forward only if the layers start from the state the forward
    started from. Parameters and buffers are restored for it (Note: [Buffers] in
    ``offload/autograd/function.py``); a layer may also keep state in plain Python attributes and
    change it in forward. Hugging Face's dynamic rotary embedding does: when a sequence is longer
    than it has seen, it grows its ``inv_freq`` buffer *and* records the new length in
    ``max_seq_len_cached`` (with the matching ``attention_scaling``). Restoring the buffer alone
    makes the recompute see the grown length, skip the growth and compute other rotary tables: wrong
    gradients, silently.

    So the plain attributes of a checkpointed slice's modules are part of the state a recompute
    restores:

    1. Before a slice's first run in forward, its modules' plain attributes are captured
       (:class:`AttributeSnapshot`): the values themselves, a tensor's version counter, and a
       shallow copy of a ``list``, ``dict`` or ``set``. Nothing is copied deeply.
    2. After each run, the live attributes are compared with the capture: a value replaced (by
       identity), an attribute added or deleted, a container's elements changed (by identity), or a
       tensor changed in place. If nothing changed, the capture stands for the next microbatch too.
    3. Each checkpoint keeps the capture that was current before its run (references: runs that
       change nothing share one). If the attributes differ from it when backward re-runs the slice
       (a run of this forward, or another forward since, changed them), backward sets the captured
       values first and sets back the values it found afterwards, so the recompute's own changes
       are discarded, as its buffer changes are. The cost: a layer that replaces a tensor
       attribute at every run (keeping its last activation, say) has each run's tensor held
       until backward, one per checkpointed microbatch.
    4. What cannot be restored is refused, not guessed: a plain tensor attribute changed in place
       (keeping a copy of every tensor attribute at every run would cost memory the layer never
       asked for) raises with advice to make it a buffer, which is restored.

    5. The ``training`` flag is module machinery but decides what a layer computes (dropout,
       batch norm): it is captured and restored like a plain attribute. ``model.eval()`` between
       a training forward and its backward (an evaluation pass before the loss's backward) leaves
       the recompute in training mode, as the plain model's graph was built.

    6. A generator attribute (a layer that draws noise from its own generator) is captured by its
       state, a run that drew from it counts as a change, and the recompute draws from the state
       the run started from; the generator continues afterwards where it was. The kinds, each read
       and set by its own accessors (:class:`_GeneratorState`): a ``torch.Generator``
       (``get_state()``: about 5 KB for a CPU generator, 16 bytes for a CUDA one); Python's
       ``random.Random`` (``getstate()``, about 7 us); NumPy's ``Generator`` (``default_rng()``),
       a bit generator and a ``RandomState`` (``bit_generator.state``, ``state``,
       ``get_state()``: under a microsecond for PCG64, about 25 us for a ``RandomState``). NumPy is
       looked up where it is loaded already, never imported for this: without it, no NumPy
       generator exists. ``random.SystemRandom`` has no state (it reads the operating system's
       entropy, so the plain model's draws cannot be repeated either) and stays a plain value.

    7. The hook tables are module machinery too, and decide what a layer computes and which
       backward hooks its graph calls: each module's forward and backward hooks and pre-hooks (with
       the tables that mark some of them ``with_kwargs`` or ``always_call``, and the flag that says
       whether its backward hooks are full ones), and the process-wide ones
       (``register_module_forward_hook`` and its kin, globals of ``torch.nn.modules.module``). The
       plain model's backward differentiates the graph its forward built: a forward hook removed
       before ``loss.backward()`` shaped it, one registered after it did not, and the full backward
       hooks that run are those the layer's call found. So a hook registered or removed between a
       forward and its backward (a steering vector applied for one forward) is a change like a
       plain attribute's:

       a. Each table is captured by a shallow copy (removing a hook deletes it from its table in
          place) and compared by its keys (a handle's id) and hooks.
       b. The recompute runs with the captured tables, installed in place (a hook's handle and
          torch's own references hold the same dictionaries), and the live ones are put back
          afterwards, also when it raises. ``torch.utils.checkpoint`` differs for forward hooks: it
          re-runs with those registered at backward time.
       c. A run that registers hooks itself (a layer that hooks its sublayers at its first call, as
          Note: [Router logits] does) may not register them again when re-run: its recompute runs
          with the hooks it started with joined by those it registered, and a hook that removed
          itself in the run runs again, as it ran in forward. The capture knows the tables at the
          run's two ends, not which hooks each module's call found: a hook registered on a module
          that had already run in that run (a later layer hooking an earlier one) runs in the
          recompute where the forward did not, and its gradients differ (documented, not refused). A layer that decides by a plain
          attribute of its own (``if not self.hooked``) registers again when re-run, the attribute
          being restored, and its hook runs twice there: such a flag belongs in an object the
          layer holds (a change inside it is not restored).
       d. Most modules have no hook: a capture keeps ``None`` for them, and capture and
          comparison cost four lookups a module. For a Hugging Face Llama decoder layer's 13
          modules without hooks (``timeit``, torch 2.13), a comparison, made after every run, went
          from 8.4 to 9.7 us and a capture from 26 to 27 us.

    Changes deeper than one level (an attribute of an attribute, an element mutated in place) are
    not seen; state kept that way must live in buffers to survive a recompute.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.modules.module as torch_module
from torch import nn

#: What ``nn.Module.__init__`` puts in every module's ``__dict__``: the module's own machinery
#: (registration tables, hooks, the training flag), not state a layer keeps.
_MODULE_MACHINERY = frozenset(vars(nn.Module()))

_CONTAINERS = (list, dict, set)

#: Exact types of plain values that are never a generator: tested before ``isinstance(value,
#: torch.Generator)``, whose metaclass check (``OpaqueBaseMeta`` in torch 2.13) costs 0.2-0.5 us a
#: miss, for each of a decoder layer's ~40 plain attributes at every run. A subclass (of ``int``,
#: say) is not among them and takes the full check.
_PLAIN = frozenset({bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device})

#: The hook tables ``nn.Module.__call__`` reads from a module's ``__dict__`` (rule 7): the forward and
#: backward hooks and pre-hooks first (all four empty: the module runs no hook), then the tables
#: that mark some of those hooks, then the flag that says whether its backward hooks are full ones.
_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_is_full_backward_hook")

#: The same for every module of the process, globals of ``torch.nn.modules.module``: torch changes
#: the tables in place and only ever sets the flag anew, so this namespace holds the live ones.
_PROCESS_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                  "_global_backward_hooks", "_global_forward_hooks_with_kwargs",
                  "_global_forward_hooks_always_called", "_global_is_full_backward_hook")
_PROCESS = vars(torch_module)

_HookTables = dict[str, Any]


def _has_hooks(space: dict[str, Any], names: tuple[str, ...]) -> bool:
    """Whether any of the four hook tables in ``space`` holds a hook."""
    return bool(space.get(names[0]) or space.get(names[1]) or space.get(names[2]) or space.get(names[3]))


def _hooked(spaces: Iterable[dict[str, Any]]) -> bool:
    """:func:`_has_hooks` for any module (its ``__dict__`` among ``spaces``), written out: this loop
    is the whole cost of rule 7 for most slices."""
    for space in spaces:
        if (space.get("_forward_pre_hooks") or space.get("_forward_hooks") or space.get("_backward_pre_hooks")
                or space.get("_backward_hooks")):
            return True
    return False


def _hooks_of(spaces: list[dict[str, Any]]) -> list[_HookTables | None] | None:
    """Each module's hook tables (``spaces``: their ``__dict__``), or ``None`` where none of them has one."""
    return [_hooks_in(space, _MODULE_HOOKS) for space in spaces] if _hooked(spaces) else None


def _hooks_in(space: dict[str, Any], names: tuple[str, ...]) -> _HookTables | None:
    """A shallow copy of each hook table in ``space`` (removing a hook deletes it from its table in
    place), and the flag, or ``None`` where no hook is registered."""
    if not _has_hooks(space, names):
        return None
    tables: _HookTables = {name: dict(space.get(name) or ()) for name in names[:-1]}
    tables[names[-1]] = space.get(names[-1])
    return tables


def _same_hooks(space: dict[str, Any], names: tuple[str, ...], saved: _HookTables | None) -> bool:
    """Whether ``space`` holds the captured hooks: the same keys (a handle's id) and functions in the
    four hook tables; the tables that mark hooks change only with them."""
    if saved is None:
        return not _has_hooks(space, names)
    return all(_same_container(space.get(name) or {}, saved[name]) for name in names[:4])


def _install_hooks(space: dict[str, Any], names: tuple[str, ...], saved: _HookTables | None) -> None:
    """Make ``space``'s hook tables hold the captured hooks (none for ``None``), in place."""
    for name in names[:-1]:
        live = space.get(name)
        if live:
            live.clear()
        if saved is not None and live is not None:
            live.update(saved[name])
    if saved is not None:
        space[names[-1]] = saved[names[-1]]


def _joined_hooks(start: _HookTables | None, end: _HookTables | None) -> _HookTables | None:
    """The hooks a run ran with as far as its two ends tell (rule 7): those it started with, joined
    by those it registered, in the order its end has them where it removed none."""
    if start is None or end is None:
        return end if start is None else start
    joined: _HookTables = {}
    for name, table in start.items():
        if isinstance(table, dict):
            joined[name] = dict(end[name]) if table.keys() <= end[name].keys() else {**table, **end[name]}
        else:  # the flag: set when a backward hook is registered, never unset
            joined[name] = end[name]
    return joined


def _captured(value: Any) -> Any:
    """What is kept of an attribute's value to tell later whether it changed and to restore it:
    ``None`` for any value but a tensor, a generator or a container, which is how
    :meth:`AttributeSnapshot.changed_since` and :meth:`AttributeSnapshot.restore` skip it."""
    if isinstance(value, torch.Tensor):
        return value._version
    kind = type(value)
    if kind in _CONTAINERS:
        return value.copy()
    if kind not in _PLAIN:  # rule 6
        generator_kind = _generator_kind(value)
        if generator_kind is not None:
            return _GeneratorState(generator_kind, value)
    return None


def _generator_kind(value: Any) -> str | None:
    """Which of rule 6's generator kinds the value is, or ``None``."""
    if isinstance(value, torch.Generator):
        return "torch"
    if isinstance(value, random.Random):
        return None if isinstance(value, random.SystemRandom) else "python"
    numpy = sys.modules.get("numpy")  # never imported here: a NumPy generator implies it is loaded
    if numpy is None:
        return None
    if isinstance(value, numpy.random.Generator):
        return "numpy generator"
    if isinstance(value, numpy.random.BitGenerator):
        return "numpy bit generator"
    if isinstance(value, numpy.random.RandomState):
        return "numpy random state"
    return None


class _GeneratorState:
    """A generator attribute's state at capture, read and set as its kind allows (rule 6)."""

    __slots__ = ("kind", "state")

    def __init__(self, kind: str, generator: Any) -> None:
        self.kind = kind
        self.state = self._read(generator)

    def _read(self, generator: Any) -> Any:
        if self.kind == "torch":
            return generator.get_state()
        if self.kind == "python":
            return generator.getstate()
        if self.kind == "numpy generator":
            return generator.bit_generator.state
        if self.kind == "numpy bit generator":
            return generator.state
        return generator.get_state(legacy=False)  # a dict whatever the bit generator beneath

    def same_as(self, generator: Any) -> bool:
        """Whether the generator is at the captured state now."""
        return _same_state(self._read(generator), self.state)

    def set_on(self, generator: Any) -> None:
        if self.kind == "torch":
            generator.set_state(self.state)
        elif self.kind == "python":
            generator.setstate(self.state)
        elif self.kind == "numpy generator":
            generator.bit_generator.state = self.state
        elif self.kind == "numpy bit generator":
            generator.state = self.state
        else:
            generator.set_state(self.state)


def _same_state(a: Any, b: Any) -> bool:
    """Equality of two generator states: a tensor, Python's tuple, or NumPy's dict of numbers and
    arrays (where ``==`` on the dicts would compare arrays element-wise and refuse a truth value)."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_state(a[key], b[key]) for key in a)
    if hasattr(a, "shape"):  # a NumPy array
        return a.shape == b.shape and bool((a == b).all())
    return a == b


def _same_container(value: Any, saved: Any) -> bool:
    if len(value) != len(saved):
        return False
    if isinstance(value, dict):
        return value.keys() == saved.keys() and all(value[k] is saved[k] for k in value)
    if isinstance(value, set):
        return value == saved
    return all(a is b for a, b in zip(value, saved))


class AttributeSnapshot:
    """The plain attributes of some modules at one moment, their ``training`` flags and their hook
    tables (Note: [Attribute state]).

    Args:
        modules: the modules to capture; each one's own attributes only (pass every submodule).
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._modules = list(modules)
        self._spaces = [vars(module) for module in self._modules]  # each one's __dict__, live
        self._entries: list[tuple[nn.Module, dict[str, tuple[Any, Any]]]] = [
            (module, {name: (value, _captured(value)) for name, value in space.items()
                      if name not in _MODULE_MACHINERY})
            for module, space in zip(self._modules, self._spaces)
        ]
        self._training = [module.training for module in self._modules]  # rule 5
        # Rule 7: per module its hook tables, None where no module has a hook (most slices).
        self._hooks = _hooks_of(self._spaces)
        self._process_hooks = _hooks_in(_PROCESS, _PROCESS_HOOKS)

    def _module_hooks(self) -> list[_HookTables | None]:
        return [None] * len(self._entries) if self._hooks is None else self._hooks

    def hooks_changed(self) -> bool:
        """Whether a hook was registered or removed since the capture, on one of the modules or
        for every module (rule 7)."""
        if not _same_hooks(_PROCESS, _PROCESS_HOOKS, self._process_hooks):
            return True
        if self._hooks is None:
            return _hooked(self._spaces)
        return not all(_same_hooks(space, _MODULE_HOOKS, saved) for space, saved in zip(self._spaces, self._hooks))

    def with_hooks_registered_since(self) -> AttributeSnapshot:
        """This capture with the hooks registered since joined to its own: what a run that
        registered or removed hooks ran with (rule 7)."""
        joined = copy.copy(self)
        now = _hooks_of(self._spaces)
        if now is not None:
            joined._hooks = [_joined_hooks(saved, found) for saved, found in zip(self._module_hooks(), now)]
        joined._process_hooks = _joined_hooks(self._process_hooks, _hooks_in(_PROCESS, _PROCESS_HOOKS))
        return joined

    def changed_since(self, strict: bool = True) -> bool:
        """Whether any attribute (a hook table among them) differs now from the capture.

        Raises:
            RuntimeError: with ``strict``, a plain tensor attribute was changed in place (rule 4);
                without, such a change is not counted (nothing could restore it).
        """
        changed = (any(module.training != flag for module, flag in zip(self._modules, self._training))
                   or self.hooks_changed())
        for module, saved in self._entries:
            live = vars(module)
            if len(live) - len(_MODULE_MACHINERY & live.keys()) != len(saved):
                changed = True
            for name, (value, extra) in saved.items():
                if name not in live or live[name] is not value:
                    changed = True
                elif extra is None:  # a plain value, the same object
                    continue
                elif isinstance(value, torch.Tensor):
                    if strict and value._version != extra:
                        raise RuntimeError(
                            f"{type(module).__name__}.{name} is a tensor attribute that its forward changed in "
                            "place; OffloadModel re-runs the layer in backward and cannot restore such a tensor. "
                            f"Register it as a buffer (module.register_buffer({name!r}, tensor, persistent=False)), "
                            "which is restored for the re-run, or assign a new tensor instead of changing it in place."
                        )
                elif isinstance(extra, _GeneratorState):
                    changed = changed or not extra.same_as(value)
                elif extra is not None and not _same_container(value, extra):
                    changed = True
        return changed

    def restore(self) -> None:
        """Put every captured value back: attributes added since are deleted, containers changed in
        place get their captured elements back (in place, so references to them stay valid), and so
        do the hook tables (a hook's handle and torch's own references reach the same dictionaries)."""
        for space, hooks in zip(self._spaces, self._module_hooks()):
            _install_hooks(space, _MODULE_HOOKS, hooks)
        _install_hooks(_PROCESS, _PROCESS_HOOKS, self._process_hooks)
        for (module, saved), training in zip(self._entries, self._training):
            module.training = training
            live = vars(module)
            for name in [n for n in live if n not in _MODULE_MACHINERY and n not in saved]:
                del live[name]
            for name, (value, extra) in saved.items():
                live[name] = value
                if extra is None or isinstance(value, torch.Tensor):
                    continue
                if isinstance(extra, _GeneratorState):
                    extra.set_on(value)
                    continue
                if _same_container(value, extra):
                    continue
                value.clear()
                if isinstance(value, list):
                    value.extend(extra)
                else:
                    value.update(extra)


class AttributeTracker:
    """For one slice's runs in one forward, the attributes each run started from (Note: [Attribute state]).

    Call :meth:`before_run` and :meth:`after_run` around every run of the slice, kept graphs
    included (a later run's change must not reach an earlier checkpoint's recompute); then
    :meth:`start_of` gives what a checkpoint restores.
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._modules = list(modules)
        self._current: AttributeSnapshot | None = None  # None: the last run changed something
        self._starts: dict[int, AttributeSnapshot] = {}
        self._running = -1  # the microbatch between before_run and after_run

    def before_run(self, microbatch: int) -> None:
        if self._current is None:
            self._current = AttributeSnapshot(self._modules)
        self._starts[microbatch] = self._current
        self._running = microbatch

    def after_run(self) -> None:
        start = self._current
        assert start is not None, "after_run without before_run"
        if start.changed_since():
            self._current = None
            if start.hooks_changed():  # the run registered hooks a re-run may not register again (rule 7)
                self._starts[self._running] = start.with_hooks_registered_since()

    def start_of(self, microbatch: int) -> AttributeSnapshot:
        return self._starts[microbatch]


@contextlib.contextmanager
def attributes_as_started(start: AttributeSnapshot | None) -> Iterator[None]:
    """Run the block with the layers' plain attributes and hooks as a forward run began with them
    (``start``; ``None``: as they are), and put back afterwards what the block found, also when it
    raises (rules 3 and 7 of Note: [Attribute state])."""
    if start is None or not start.changed_since(strict=False):
        yield
        return
    now = AttributeSnapshot(start._modules)
    start.restore()
    try:
        yield
    finally:
        now.restore()
