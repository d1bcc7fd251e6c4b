"""Tensors inside containers that torch's pytree keeps whole, and sparse tensors, at the model's
input, between slices and at its output.

A dataclass, a dict or list subclass or a ``UserDict`` is opened where it holds a tensor and put
back together as its own type (Note: [Containers pytree keeps whole] in
``offload/walk/structures.py``): the input's gradient, the parameters' gradients and the output
equal the plain model's bit for bit. A sparse tensor that needs no gradient crosses checkpointed
boundaries; one that needs a gradient across a boundary is refused (Note: [Sparse boundary
leaves] in ``offload/autograd/records.py``).
"""

from __future__ import annotations

import copy
import types
from collections import OrderedDict, UserDict, UserList
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn

from offload import OffloadModel

from .helpers import ACTIVATIONS, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}
MODES = ["recompute", "kept", "offload_all"]


@dataclass
class Batch:
    x: torch.Tensor
    scale: float = 2.0


@dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor


class Features(OrderedDict):
    """A dict as transformers' ``BatchFeature``-like containers are."""


class Rows(list):
    pass


class Pair(tuple):
    """A tuple subclass that is no namedtuple: nothing can put a tensor back into it."""


#: How each container kind wraps a tensor, and how a layer reads it back.
CONTAINERS: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]] = {
    "dataclass": (lambda t: Batch(t), lambda b: b.x * b.scale),
    "frozen_dataclass": (lambda t: FrozenBatch(t), lambda b: b.x),
    "ordered_dict_subclass": (lambda t: Features(x=t), lambda b: b["x"]),
    "user_dict": (lambda t: UserDict(x=t), lambda b: b["x"]),
    "list_subclass": (lambda t: Rows([t]), lambda b: b[0]),
    "user_list": (lambda t: UserList([t]), lambda b: b[0]),
}


class Read(nn.Module):
    """Reads the tensor out of its container."""

    def __init__(self, kind: str, width: int = 6):
        super().__init__()
        self.get = CONTAINERS[kind][1]
        self.l = nn.Linear(width, width)

    def forward(self, container: Any) -> torch.Tensor:
        return self.l(self.get(container))


class Wrap(nn.Module):
    """Puts its result into a container."""

    def __init__(self, kind: str, width: int = 6):
        super().__init__()
        self.put = CONTAINERS[kind][0]
        self.l = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> Any:
        return self.put(torch.tanh(self.l(x)))


def _offloaded(plain: nn.Module, **settings: Any) -> OffloadModel:
    return OffloadModel(copy.deepcopy(plain), device="cpu", **settings)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_a_tensor_inside_a_container_input_gets_the_plain_models_gradient(kind, mode):
    torch.manual_seed(0)
    plain = nn.Sequential(Read(kind), nn.Tanh(), nn.Linear(6, 3))
    model = _offloaded(plain, num_slices=3, **ACTIVATIONS[mode])
    x = torch.randn(4, 6)
    x_plain, x_offloaded = x.clone().requires_grad_(), x.clone().requires_grad_()
    wrap = CONTAINERS[kind][0]
    plain(wrap(x_plain)).pow(2).sum().backward()
    model(wrap(x_offloaded)).pow(2).sum().backward()
    assert x_offloaded.grad is not None, "the tensor inside the container got no gradient"
    torch.testing.assert_close(x_offloaded.grad, x_plain.grad, **EXACT)
    assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["dataclass", "ordered_dict_subclass", "user_dict", "list_subclass"])
def test_a_container_crosses_every_boundary_and_is_the_output(kind, mode):
    torch.manual_seed(0)
    plain = nn.Sequential(Wrap(kind), Read(kind), Wrap(kind), Read(kind), Wrap(kind))
    model = _offloaded(plain, num_slices=5, **ACTIVATIONS[mode])
    x = torch.randn(4, 6)
    x_plain, x_offloaded = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = plain(x_plain), model(x_offloaded)
    assert type(got) is type(expected)
    read = CONTAINERS[kind][1]
    torch.testing.assert_close(read(got), read(expected), **EXACT)
    read(expected).pow(2).sum().backward()
    read(got).pow(2).sum().backward()
    torch.testing.assert_close(x_offloaded.grad, x_plain.grad, **EXACT)
    assert_same_grads(model, plain, **EXACT)
    with torch.no_grad():  # the forward that keeps no graph rebuilds the same structure
        assert type(model(x)) is type(expected)


@dataclass
class Nested:
    """A dataclass holding a dict subclass holding a list: each opened in turn."""

    features: Features
    count: int
    name: str = "nested"


class MakeNested(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)

    def forward(self, batch: Batch) -> Nested:
        h = self.l(batch.x)
        return Nested(Features(h=h, parts=[h.relu(), batch.scale]), count=3)


class TakeNested(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 3)

    def forward(self, nested: Nested) -> torch.Tensor:
        relu, scale = nested.features["parts"]
        return self.l(nested.features["h"] * scale + relu) * nested.count


def test_nested_containers_keep_their_values_that_are_not_tensors():
    torch.manual_seed(0)
    plain = nn.Sequential(MakeNested(), TakeNested())
    model = _offloaded(plain, num_slices=2)
    x = torch.randn(4, 6)
    x_plain, x_offloaded = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain(Batch(x_plain, scale=0.5)).sum().backward()
    model(Batch(x_offloaded, scale=0.5)).sum().backward()
    torch.testing.assert_close(x_offloaded.grad, x_plain.grad, **EXACT)
    assert_same_grads(model, plain, **EXACT)
    out = nn.Sequential(MakeNested())(Batch(x))
    rebuilt = _offloaded(nn.Sequential(copy.deepcopy(plain[0])), num_slices=1)(Batch(x))
    assert (type(rebuilt), type(rebuilt.features), rebuilt.count, rebuilt.name) == (Nested, Features, 3, "nested")
    assert list(rebuilt.features) == list(out.features)


def test_microbatches_cut_a_tensor_inside_a_dataclass_as_inside_a_dict():
    # The dataclass was one leaf, handed whole to every microbatch; opened, it is cut as a dict is.
    torch.manual_seed(0)
    layers = nn.Sequential(Read("ordered_dict_subclass"), nn.Tanh(), nn.Linear(6, 3))
    as_dict, as_subclass = _offloaded(layers, num_slices=3, num_microbatches=2), _offloaded(layers, num_slices=3,
                                                                                           num_microbatches=2)
    x = torch.randn(5, 6)
    x_dict, x_subclass = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_dict, y_subclass = as_dict({"x": x_dict}), as_subclass(Features(x=x_subclass))
    torch.testing.assert_close(y_subclass, y_dict, **EXACT)
    y_dict.pow(2).sum().backward()
    y_subclass.pow(2).sum().backward()
    torch.testing.assert_close(x_subclass.grad, x_dict.grad, **EXACT)
    assert_same_grads(as_subclass, as_dict, **EXACT)


class Noted(dict):
    """A dict subclass with an attribute of its own."""

    def __init__(self, *args: Any, note: str = "", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.note = note


class KeepNoted(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)

    def forward(self, d: Noted) -> Noted:
        return Noted(h=self.l(d["h"]), note=d.note + "+")


def test_a_rebuilt_container_keeps_its_attributes_and_a_plain_config_stays_one_object():
    torch.manual_seed(0)
    model = _offloaded(nn.Sequential(KeepNoted(), KeepNoted()), num_slices=2)
    out = model(Noted(h=torch.randn(2, 6, requires_grad=True), note="a"))
    assert type(out) is Noted and out.note == "a++" and list(out) == ["h"]

    @dataclass
    class Config:  # holds no tensor: stays a leaf, the same object in every slice
        size: tuple[int, ...]

    seen = []
    hook = lambda module, args: seen.append(args[0][1])  # noqa: E731
    layers = nn.Sequential(nn.Identity(), nn.Identity())
    for layer in layers:
        layer.register_forward_pre_hook(hook)
    config = Config(size=torch.Size([2, 6]))
    _offloaded(layers, num_slices=2)((torch.randn(2, 6, requires_grad=True), config))
    assert len(seen) == 2 and all(c is config for c in seen)


class Counting(nn.Linear):
    calls = 0

    def forward(self, x: Any) -> torch.Tensor:
        Counting.calls += 1
        return super().forward(x[0])


@pytest.mark.parametrize("container", [
    pytest.param(lambda t: Pair((t, t)), id="tuple_subclass"),
    pytest.param(lambda t: types.MappingProxyType({"x": t}), id="read_only_mapping"),
    pytest.param(lambda t: Noted(x=t, note=t), id="tensor_in_an_attribute_of_a_dict_subclass"),
])
def test_a_container_that_cannot_be_put_back_together_is_refused_before_any_slice_runs(container):
    model = _offloaded(nn.Sequential(Counting(6, 6), nn.Tanh()), num_slices=2)
    Counting.calls = 0
    with pytest.raises(TypeError, match=r"the model's input holds a tensor (among the items|in an attribute, besides the "
                                          r"items,) of a .*register_pytree_node"):
        model(container(torch.randn(2, 6, requires_grad=True)))
    assert Counting.calls == 0
    assert all(p.grad is None for p in model.parameters())


class EmitPair(nn.Module):
    def forward(self, x: torch.Tensor) -> Pair:
        return Pair((x, x))


def test_a_slice_output_that_cannot_be_put_back_together_is_refused_naming_the_slice():
    model = _offloaded(nn.Sequential(nn.Linear(6, 6), EmitPair(), Counting(6, 6)), num_slices=3)
    with pytest.raises(TypeError, match=r"slice 1's output holds a tensor among the items of a Pair"):
        model(torch.randn(2, 6))


# -- sparse tensors ---------------------------------------------------------------------------------


class GraphConv(nn.Module):
    """Features and a sparse adjacency in, both out: the adjacency crosses every boundary."""

    def __init__(self, width_in: int, width_out: int):
        super().__init__()
        self.l = nn.Linear(width_in, width_out)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, adjacency = inputs
        return torch.relu(torch.sparse.mm(adjacency, self.l(h))), adjacency


def _adjacency(nodes: int) -> torch.Tensor:
    dense = (torch.rand(nodes, nodes) > 0.6).float() + torch.eye(nodes)
    return (dense / dense.sum(1, keepdim=True)).to_sparse()


@pytest.mark.parametrize("mode", MODES)
def test_a_sparse_adjacency_that_needs_no_gradient_crosses_every_boundary(mode):
    torch.manual_seed(0)
    plain = nn.Sequential(GraphConv(5, 8), GraphConv(8, 8), GraphConv(8, 3))
    model = _offloaded(plain, num_slices=3, **ACTIVATIONS[mode])
    adjacency, x = _adjacency(7), torch.randn(7, 5)
    x_plain, x_offloaded = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = plain((x_plain, adjacency)), model((x_offloaded, adjacency))
    torch.testing.assert_close(got[0], expected[0], **EXACT)
    assert got[1].layout == torch.sparse_coo
    expected[0].pow(2).sum().backward()
    got[0].pow(2).sum().backward()
    torch.testing.assert_close(x_offloaded.grad, x_plain.grad, **EXACT)
    assert_same_grads(model, plain, **EXACT)


class ToSparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.l(x)).to_sparse()


class FromSparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 3))

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(s, self.w)


@pytest.mark.parametrize("mode", ["recompute", "kept"])
def test_a_sparse_tensor_that_needs_a_gradient_across_a_boundary_is_refused(mode):
    torch.manual_seed(0)
    model = _offloaded(nn.Sequential(nn.Linear(4, 4), ToSparse(), FromSparse()), num_slices=3, **ACTIVATIONS[mode])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"slice 2 receives a sparse tensor .* needs a gradient, from slice 1's "
                                           r"output.*to_dense"):
        model(torch.randn(5, 4))
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # Within one slice autograd takes it as in the plain model.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), ToSparse(), FromSparse())
    joined = _offloaded(plain, num_slices=2, **ACTIVATIONS[mode])
    x = torch.randn(5, 4)
    plain(x).sum().backward()
    joined(x).sum().backward()
    assert_same_grads(joined, plain, **EXACT)


class Carrier:
    """A plain class, which OffloadModel does not open."""

    def __init__(self, h: torch.Tensor):
        self.h = h


class Carry(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> Carrier:
        return Carrier(self.l(x))


class Unpack(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(6, 3)

    def forward(self, carrier: Carrier) -> torch.Tensor:
        return self.l(carrier.h)


def test_an_activation_inside_a_plain_object_across_a_boundary_is_refused_saying_what_to_pass():
    model = _offloaded(nn.Sequential(Carry(), Unpack()), num_slices=2)
    with pytest.raises(RuntimeError, match=r"slice 1 used a parameter .* inside an object OffloadModel does not "
                                           r"open .* tuple, dict, namedtuple or dataclass"):
        model(torch.randn(2, 6))


# -- a weight handed on inside a container ----------------------------------------------------------


@dataclass
class Held:
    h: torch.Tensor
    w: torch.Tensor


#: How a container holds features and a weight, and how a layer reads them back.
HOLDERS: dict[str, tuple[Callable[..., Any], Callable[[Any], tuple[torch.Tensor, torch.Tensor]]]] = {
    "dataclass": (lambda h, w: Held(h, w), lambda b: (b.h, b.w)),
    "ordered_dict_subclass": (lambda h, w: Features(h=h, w=w), lambda b: (b["h"], b["w"])),
}


class EmitWeight(nn.Module):
    """Hands its weight on, which OffloadModel binds to a view of the slice's slot."""

    def __init__(self, kind: str):
        super().__init__()
        self.put, self.get = HOLDERS[kind]
        self.l = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> Any:
        return self.put(torch.tanh(self.l(x)), self.l.weight)


class PassWeight(EmitWeight):
    def forward(self, held: Any) -> Any:
        h, w = self.get(held)
        return self.put(torch.tanh(self.l(h)), w)


class UseWeight(EmitWeight):
    def forward(self, held: Any) -> torch.Tensor:
        h, w = self.get(held)
        return self.l(h) @ w.T


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(HOLDERS))
def test_a_weight_handed_on_inside_a_container_gets_memory_of_its_own_before_its_slot_is_reused(kind, mode):
    # The weight, a view of slice 0's slot, was missed inside a dataclass and read by slice 4 after
    # the slot held another slice's weights.
    torch.manual_seed(0)
    plain = nn.Sequential(EmitWeight(kind), PassWeight(kind), PassWeight(kind), PassWeight(kind), UseWeight(kind))
    model = _offloaded(plain, num_slices=5, **ACTIVATIONS[mode])
    x = torch.randn(4, 6)
    x_plain, x_offloaded = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected, got = plain(x_plain), model(x_offloaded)
    torch.testing.assert_close(got, expected, **EXACT)
    expected.pow(2).sum().backward()
    got.pow(2).sum().backward()
    torch.testing.assert_close(x_offloaded.grad, x_plain.grad, **EXACT)
    assert_same_grads(model, plain, **EXACT)
    with torch.no_grad():  # the walk without a graph runs the same slices
        torch.testing.assert_close(model(x), plain(x), **EXACT)


# -- what the planner sees of a container -----------------------------------------------------------


@dataclass
class Features2:
    h: torch.Tensor
    extra: torch.Tensor


class EmitFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(64, 64)

    def forward(self, x: Any) -> Features2:
        h, extra = (x.h, x.extra) if isinstance(x, Features2) else (x, x)
        return Features2(torch.tanh(self.l(h)), extra * 2)


class ReadFeatures(EmitFeatures):
    def forward(self, x: Features2) -> torch.Tensor:
        return self.l(x.h) + x.extra


def test_the_planner_counts_the_tensors_a_dataclass_carries_across_boundaries_as_a_run_keeps_them():
    # Profiled through torch's pytree the dataclass was one leaf: no bytes crossed any boundary
    # (8,192 estimated for the model's input alone against 40,960 measured).
    from offload import estimate_memory
    from offload.planning.shapes import profile_layers

    torch.manual_seed(0)
    plain = nn.Sequential(EmitFeatures(), EmitFeatures(), EmitFeatures(), ReadFeatures())
    profile = profile_layers(plain, lambda: torch.zeros(32, 64))
    assert [layer.output_bytes for layer in profile.layers[:-1]] == [2 * 32 * 64 * 4] * 3
    estimate = estimate_memory(plain, num_slices=4, profile=profile, device="cpu")
    model = _offloaded(plain, num_slices=4)
    y = model(torch.randn(32, 64, requires_grad=True))  # its graph holds the boundary activations
    assert estimate.host_activations == model.memory_footprint().host_activations
    del y
    # Its batch and its tensors' dtype are the model's input's, as OffloadModel reads them.
    cast = profile_layers(plain, lambda: Features2(torch.zeros(32, 64), torch.zeros(32, 64)),
                          compute_dtype=torch.bfloat16)
    assert (cast.batch_size, cast.input_bytes) == (32, 2 * 32 * 64 * 2)
    # Within a slice a layer may return a container the walk could not rebuild: counted, not refused.
    paired = profile_layers(nn.Sequential(EmitPair(), nn.Identity()), lambda: torch.zeros(32, 64))
    assert paired.layers[0].output_bytes == 32 * 64 * 4
