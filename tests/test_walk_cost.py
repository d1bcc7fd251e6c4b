"""The walk's own bookkeeping per slice: the shortcuts that keep it cheap, and that each gives the
answer of the full computation it skips (``benchmarks/bench_walk.py`` measures the cost itself).

- Plain attributes of a slice's modules skip the generator check (Note: [Attribute state]);
- boundary leaves in distinct storages skip the search for aliases (Note: [Boundary leaves that
  alias each other] in ``offload/autograd/slice_graph.py``);
- a backward reads what is known of its parameters from the live engines once (Note: [Adding
  onto earlier gradients] in ``offload/autograd/outside_gradients.py``).
"""

from __future__ import annotations

import builtins
import copy
from typing import Any

import pytest
import torch
from torch import nn

from offload import OffloadModel
from offload.autograd import call, outside_gradients
from offload.walk import module_state
from offload.walk.engine import engines_holding
from offload.walk.module_state import AttributeSnapshot

EXACT = {"rtol": 0.0, "atol": 0.0}


# -- attributes: the generator check --------------------------------------------------------------


class NoiseGenerator(torch.Generator):
    """A generator subclass: rule 6 of Note: [Attribute state] holds for it as for the base class."""


class Plain(nn.Module):
    """Plain attributes of the kinds a decoder layer keeps, beside a generator of its own."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.hidden_size, self.scaling, self.is_causal, self.name, self.absent = 4, 0.5, True, "layer", None
        self.dtype, self.where = torch.float32, torch.device("cpu")
        self.rows = [1, 2]
        if generator is not None:
            self.generator = generator


def counting_generator_checks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The values module_state asks ``isinstance(value, torch.Generator)`` about, from now on."""
    asked: list[Any] = []

    def isinstance_counted(value: Any, kinds: Any) -> bool:
        if kinds is torch.Generator:
            asked.append(value)
        return builtins.isinstance(value, kinds)

    monkeypatch.setattr(module_state, "isinstance", isinstance_counted, raising=False)
    return asked


def test_plain_attributes_are_never_checked_for_a_generator(monkeypatch):
    module = Plain()
    asked = counting_generator_checks(monkeypatch)
    snapshot = AttributeSnapshot(module.modules())
    module.scaling = 0.25
    assert snapshot.changed_since()
    snapshot.restore()
    assert module.scaling == 0.5
    # Only the list reaches the check, and only where it may have changed (in changed_since).
    assert all(type(value) is list for value in asked), [type(value) for value in asked]


@pytest.mark.parametrize("kind", [torch.Generator, NoiseGenerator])
def test_a_generator_attribute_is_captured_by_its_state_and_restored(kind):
    generator = kind().manual_seed(3)
    module = Plain(generator)
    snapshot = AttributeSnapshot(module.modules())
    assert not snapshot.changed_since()
    first = torch.randn(5, generator=generator)
    assert snapshot.changed_since()  # a draw counts as a change
    snapshot.restore()
    assert module.generator is generator
    torch.testing.assert_close(torch.randn(5, generator=generator), first, **EXACT)


def test_a_subclass_of_a_plain_type_takes_the_full_check(monkeypatch):
    class Width(int):
        pass

    module = Plain()
    module.hidden_size = Width(4)
    asked = counting_generator_checks(monkeypatch)
    AttributeSnapshot(module.modules())
    assert [type(value) for value in asked] == [Width]


# -- boundary leaves: the search for aliases -----------------------------------------------------


def leaf_sets() -> dict[str, tuple[list[Any], list[bool]]]:
    """Boundaries with and without leaves in one storage, with non-tensor and empty leaves among them."""
    x = torch.randn(4, 6, requires_grad=True)
    complex_base = torch.randn(3, dtype=torch.complex64)
    other = torch.randn(4, 6)
    empty = torch.empty(0)
    cases = {
        "distinct": [x, None, other, 3, torch.arange(4), empty, empty],
        "a view and its base": [x[:, :2], other, x],
        "the same tensor twice": [x, x],
        "overlapping slices": [x[:, :-1], x[:, 1:]],
        "a detached view": [x, x.detach()[1]],
        "a conjugate view": [complex_base, complex_base.conj()],
        "meta tensors, address 0": [torch.empty(3, device="meta"), torch.empty(3, device="meta")],
    }
    return {name: (leaves, [isinstance(t, torch.Tensor) and t.requires_grad for t in leaves])
            for name, leaves in cases.items()}


@pytest.mark.parametrize("name", list(leaf_sets()))
def test_bases_among_answers_as_the_full_search(name):
    leaves, requires = leaf_sets()[name]
    for wants in (requires, [True] * len(leaves)):
        assert call.bases_among(leaves, wants) == call._search(leaves, wants)


def test_bases_among_in_distinct_storages_skips_the_search(monkeypatch):
    leaves, requires = leaf_sets()["distinct"]

    def refused(*args: Any) -> None:
        raise AssertionError("searched leaves that share no storage")

    monkeypatch.setattr(call, "_search", refused)
    assert call.bases_among(leaves, requires) == {}


# -- what backward knows of its parameters --------------------------------------------------------


def known_clean_one_by_one(param: torch.Tensor) -> bool:
    """The verdict as read per parameter before Verdicts: all engines holding it say clean."""
    verdicts = [e.known_sources.get(id(param)) for e in engines_holding(param)]
    return bool(verdicts) and all(verdicts)


def known_one_by_one(param: torch.Tensor) -> bool:
    return any(id(param) in e.known_sources for e in engines_holding(param))


def assert_verdicts_as_one_by_one(params: list[torch.Tensor]) -> None:
    verdicts = outside_gradients.Verdicts.now()
    assert [id(p) in verdicts.clean for p in params] == [known_clean_one_by_one(p) for p in params]
    assert [id(p) in verdicts.known for p in params] == [known_one_by_one(p) for p in params]


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8))


def accumulate(model: nn.Module, penalty: bool = False) -> None:
    """Two backwards into .grad: the second adds onto the first's (Note: [Adding onto earlier gradients])."""
    weight = next(iter(model.parameters()))
    model.zero_grad()
    for k in range(2):
        loss = model(torch.randn(3, 8, generator=torch.Generator().manual_seed(k))).square().mean()
        if penalty and k == 1:
            loss = loss + weight.square().sum()
        loss.backward()


def test_verdicts_read_at_once_equal_the_verdicts_per_parameter():
    model = OffloadModel(network(), device="cpu", num_slices=3)
    params = list(model.parameters())
    stranger = torch.zeros(2, requires_grad=True)  # held by no engine: neither clean nor known
    assert_verdicts_as_one_by_one(params + [stranger])  # nothing judged yet
    accumulate(model)
    assert all(known_clean_one_by_one(p) for p in params)
    assert_verdicts_as_one_by_one(params + [stranger])
    with pytest.raises(RuntimeError, match="also came from outside the model"):
        accumulate(model, penalty=True)  # the first weight is known outside from now on
    assert not known_clean_one_by_one(params[0]) and known_one_by_one(params[0])
    assert_verdicts_as_one_by_one(params + [stranger])
    # A second model sharing a parameter has judged nothing yet: no longer clean for either.
    shared = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    shared[0].weight = params[2]
    other = OffloadModel(shared, device="cpu", num_slices=1)
    assert_verdicts_as_one_by_one(params + list(other.parameters()) + [stranger])
    assert not known_clean_one_by_one(shared[0].weight)
    del other


def test_a_backward_reads_the_live_engines_once_not_once_per_parameter(monkeypatch):
    """Every parameter known and nothing added onto earlier gradients (``set_to_none``): nothing is
    watched, and no parameter's engines are looked up one by one."""
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    accumulate(model)  # every parameter judged clean
    looked_up: list[torch.Tensor] = []

    def counted(p: torch.Tensor) -> list[Any]:
        looked_up.append(p)
        return engines_holding(p)

    monkeypatch.setattr(outside_gradients, "engines_holding", counted)
    for module in (model, plain):
        module.zero_grad(set_to_none=True)
        module(torch.randn(3, 8, generator=torch.Generator().manual_seed(7))).square().mean().backward()
    assert looked_up == []
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **EXACT)
