"""Ctrl-C's ``KeyboardInterrupt`` while a slice's device copies are bound into the user's layers or
given back: the layers hold their own parameters afterwards, and training on from the pre-step
state equals the plain model bit for bit (Note: [Interrupts while binding] in
``offload/walk/binding.py``). Each interrupt is raised by a trace function at one event (a call or a
line) of ``binding.py`` or ``sites.py``, where a signal handler would raise it, so the tests are
deterministic; every event of a forward and backward is tried (a ``try:`` line is no event: no
signal lands there)."""

from __future__ import annotations

import contextlib
import faulthandler
import inspect
import linecache
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from offload import OffloadModel, OffloadOptimizer
from offload.streams import sites as sites_module
from offload.streams.sites import Site
from offload.walk import binding as binding_module
from offload.walk.binding import Binding, give_back_unheld

from .test_optimizer import EXACT, loss_of, network

pytestmark = pytest.mark.filterwarnings("ignore:.*per-tensor CPU implementation")

KWARGS = {"lr": 1e-2, "fused": True}
FILES = {binding_module.__file__, sites_module.__file__}
_exit_source, _exit_start = inspect.getsourcelines(Binding.__exit__)
#: The first line of ``__exit__``: an interrupt there (or as the call starts) lands before any of
#: its code runs, so the binding stays listed until the next one (rule 4 of the note).
EXIT_FIRST_LINE = _exit_start + next(k for k, line in enumerate(_exit_source) if "self._held_by = None" in line)


@pytest.fixture(autouse=True)
def bounded_in_time() -> Iterator[None]:
    faulthandler.dump_traceback_later(300, exit=True)  # a hang fails the run with every thread's stack
    yield
    faulthandler.cancel_dump_traceback_later()


class Interrupts:
    """A trace function that raises KeyboardInterrupt at event ``at`` (counted from 1 over the
    calls and lines of ``binding.py`` and ``sites.py``), as a signal handler would; and, with
    ``second_after``, a second one as the ``second_after``-th call in them after it starts (where
    a signal lands: at the start of a function). A trace function that raised is unset, so the
    second comes from a profile function."""

    def __init__(self, at: int, second_after: int | None = None) -> None:
        self.at = at
        self.second_after = second_after
        self.count = 0
        self.calls_after = 0
        self.fired: list[tuple[str, int, str]] = []

    def __enter__(self) -> Interrupts:
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(None)
        sys.setprofile(None)

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename not in FILES:
            return None
        self._hit(frame, event)
        return self._line

    def _line(self, frame: FrameType, event: str, arg: Any) -> Any:
        # Not at a ``try:``: Python checks for a signal as a function starts and as a loop turns,
        # never at the no-op that marks where a try begins.
        if event == "line" and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip() != "try:":
            self._hit(frame, event)
        return self._line

    def _hit(self, frame: FrameType, event: str) -> None:
        self.count += 1
        if self.count == self.at:
            self.fired.append((frame.f_code.co_name, frame.f_lineno, event))
            if self.second_after is not None:
                sys.setprofile(self._second)
            raise KeyboardInterrupt

    def _second(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_filename not in FILES:
            return
        self.calls_after += 1
        if self.calls_after == self.second_after:
            self.fired.append((frame.f_code.co_name, frame.f_lineno, event))
            raise KeyboardInterrupt

    def before_exit_ran(self) -> bool:
        """Whether the first interrupt landed in ``Binding.__exit__`` before any of its code ran."""
        name, line, event = self.fired[0]
        return name == "__exit__" and (event == "call" or line == EXIT_FIRST_LINE)


def twins() -> tuple[nn.Module, torch.optim.Optimizer, OffloadModel, OffloadOptimizer]:
    """The unwrapped network and its plain AdamW; an OffloadModel of the same and its optimizer."""
    plain_model = network()
    plain = torch.optim.AdamW(plain_model.parameters(), **KWARGS)
    model = OffloadModel(network(), device="cpu", num_slices=3)
    return plain_model, plain, model, OffloadOptimizer(model, torch.optim.AdamW, **KWARGS)


def train(model: nn.Module, optimizer: Any, step: int) -> None:
    optimizer.zero_grad()
    loss_of(model, step).backward()
    optimizer.step()


def own_parameters(model: nn.Module) -> dict[tuple[int, str], nn.Parameter]:
    return {(id(m), name): p for m in model.modules() for name, p in m._parameters.items()}


def sites_not_their_own(model: nn.Module, own: dict[tuple[int, str], nn.Parameter]) -> list[str]:
    return [f"{type(m).__name__}.{name}" for m in model.modules() for name, p in m._parameters.items()
            if own[(id(m), name)] is not p]


def events_of_one_step(model: OffloadModel, optimizer: OffloadOptimizer, step: int) -> int:
    """Train one step; the number of events of its forward and backward."""
    optimizer.zero_grad()
    with Interrupts(0) as counted:
        loss = loss_of(model, step)
        loss.backward()
    optimizer.step()
    return counted.count


def interrupted_steps(second_after: int | None, stride: int) -> None:
    """For each event ``k`` of a forward and backward (every ``stride``-th), a step interrupted at
    ``k`` (and ``second_after`` calls later): the layers hold their own parameters, and the step done
    again after it trains on exactly as the plain model."""
    plain_model, plain, model, optimizer = twins()
    own = own_parameters(model)
    for step in range(2):  # the first laid out, the second as every later one
        train(plain_model, plain, step)
        events = events_of_one_step(model, optimizer, step)
    step = 2
    for k in range(1, events + 1, stride):
        optimizer.zero_grad()
        with pytest.raises(KeyboardInterrupt), Interrupts(k, second_after) as interrupts:
            loss_of(model, step).backward()
        left = sites_not_their_own(model, own)
        if second_after is None and not interrupts.before_exit_ran():
            assert left == [], f"interrupted at {interrupts.fired}"
        # Rule 4: what no giving back finished (an interrupt as __exit__ started, or a second one)
        # is given back by the next forward's Engine.refresh, before it reads the layers' registrations.
        train(model, optimizer, step)
        assert sites_not_their_own(model, own) == [], f"interrupted at {interrupts.fired}"
        assert binding_module._listed() == []
        train(plain_model, plain, step)
        optimizer.synchronize()
        for p, q in zip(model.parameters(), plain_model.parameters()):
            torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"interrupted at {interrupts.fired}: {m}")
        step += 1


def test_an_interrupt_at_any_event_of_binding_gives_the_parameters_back_and_training_on_is_exact():
    interrupted_steps(second_after=None, stride=1)


@pytest.mark.parametrize("second_after", [1, 2, 5])
def test_a_second_interrupt_while_giving_back_leaves_it_to_give_back_later(second_after: int):
    interrupted_steps(second_after=second_after, stride=3)


def test_the_reproducer_a_signal_as_refresh_flat_weights_starts(monkeypatch):
    """The hunter's case: Ctrl-C as ``__enter__`` calls ``_refresh_flat_weights``, every site bound."""
    plain_model, plain, model, optimizer = twins()
    own = own_parameters(model)
    train(plain_model, plain, 0)
    train(model, optimizer, 0)
    real = binding_module._refresh_flat_weights
    calls = [0]

    def refresh(sites: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise KeyboardInterrupt
        real(sites)

    monkeypatch.setattr(binding_module, "_refresh_flat_weights", refresh)
    optimizer.zero_grad()
    with pytest.raises(KeyboardInterrupt):
        loss_of(model, 1).backward()
    assert sites_not_their_own(model, own) == []
    for step in range(1, 4):
        train(model, optimizer, step)
        train(plain_model, plain, step)
    optimizer.synchronize()
    for p, q in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, **EXACT)


class Stack(nn.Module):
    """A layer with each kind of site the binding restores: a Linear, an LSTM (whose flat weight
    list follows the swap) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)
        self.lstm = nn.LSTM(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.linear(x) * self.scale)[0]


def binding_of(layer: nn.Module) -> tuple[Binding, dict[Site, torch.Tensor]]:
    """A binding of copies of every tensor ``layer`` registers, and the host tensors by site."""
    host: dict[Site, torch.Tensor] = {}
    for module in layer.modules():
        for name, p in module._parameters.items():
            host[Site(module, name, True)] = p
        for name, b in module._buffers.items():
            host[Site(module, name, False)] = b
    copies = [nn.Parameter(t.detach().clone()) if site.is_parameter else t.clone() for site, t in host.items()]
    return Binding([[site] for site in host], copies, []), host


def held_as_before(layer: nn.Module, host: dict[Site, torch.Tensor]) -> bool:
    flat = layer.lstm._flat_weights
    return (all(site.table()[site.name] is t for site, t in host.items())
            and all(w is getattr(layer.lstm, n) for w, n in zip(flat, layer.lstm._flat_weights_names)))


def test_an_interrupt_under_a_parametrization_cache_gives_the_caller_its_cache_back():
    layer = Stack()
    x = torch.randn(3, 4)
    bound, host = binding_of(layer)
    with Interrupts(0) as counted:
        run(bound, layer, x)
    for k in range(1, counted.count + 1):
        bound, host = binding_of(layer)
        interrupts = Interrupts(k)
        with parametrize.cached():
            cache = parametrize._cache
            with pytest.raises(KeyboardInterrupt):
                run(bound, layer, x, interrupts)
            if not interrupts.before_exit_ran():
                assert parametrize._cache is cache, f"interrupted at {interrupts.fired}"
                assert held_as_before(layer, host), f"interrupted at {interrupts.fired}"
            give_back_unheld()
            assert parametrize._cache is cache, f"interrupted at {interrupts.fired}"
        assert held_as_before(layer, host), f"interrupted at {interrupts.fired}"
        assert binding_module._listed() == []


def run(bound: Binding, layer: nn.Module, x: torch.Tensor, interrupts: Interrupts | None = None) -> None:
    """Run ``layer`` under ``bound`` (in a frame of its own, gone when it returns or raises)."""
    with interrupts or contextlib.nullcontext(), bound:
        layer(x)


def run_stopped_as_exit_starts(bound: Binding, layer: nn.Module, x: torch.Tensor) -> None:
    """Run ``layer`` under ``bound``, with an interrupt as ``__exit__`` starts: none of it runs."""
    with pytest.raises(KeyboardInterrupt):
        _run_then_interrupt(bound, layer, x)
    sys.settrace(None)


def _run_then_interrupt(bound: Binding, layer: nn.Module, x: torch.Tensor) -> None:
    with bound:
        layer(x)
        sys.settrace(Interrupts(1)._call)  # the next event there: the call of __exit__


def test_the_next_binding_gives_back_one_an_interrupt_left_before_exit_ran():
    """An interrupt as ``__exit__`` starts leaves the binding listed; the next binding (of any
    layer) gives it back before it binds, so what it records as the host copies is right."""
    layer, other = Stack(), Stack()
    x = torch.randn(3, 4)
    first, host = binding_of(layer)
    run_stopped_as_exit_starts(first, layer, x)
    assert not held_as_before(layer, host)
    assert binding_module._listed() == [first]
    second, other_host = binding_of(other)
    with second:
        assert held_as_before(layer, host)
        other(x)
    assert held_as_before(other, other_host)
    assert binding_module._listed() == []


def test_a_binding_made_inside_another_run_leaves_the_outer_ones_device_copies_bound():
    outer_layer, inner_layer = Stack(), Stack()
    x = torch.randn(3, 4)
    outer, outer_host = binding_of(outer_layer)
    with outer:
        bound = {site: site.table()[site.name] for site in outer_host}
        inner, inner_host = binding_of(inner_layer)
        with inner:
            inner_layer(x)
        assert all(site.table()[site.name] is t for site, t in bound.items())
        assert held_as_before(inner_layer, inner_host)
        # An inner binding that an interrupt stopped as its exit started: the next binding gives
        # it back, not the outer one, whose run still holds its device copies.
        failed, failed_host = binding_of(inner_layer)
        run_stopped_as_exit_starts(failed, inner_layer, x)
        assert not held_as_before(inner_layer, failed_host)
        third_layer = Stack()
        third, third_host = binding_of(third_layer)
        with third:
            assert all(site.table()[site.name] is t for site, t in bound.items())
            assert held_as_before(inner_layer, failed_host)
            third_layer(x)
        outer_layer(x)
    assert held_as_before(outer_layer, outer_host)
    assert held_as_before(third_layer, third_host)
    assert binding_module._listed() == []
