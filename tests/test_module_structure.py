"""An OffloadModel's top-level layers: read as ``nn.Sequential`` reads them, fixed once they are cut
into slices (Note: [Layers fixed at wrapping] in ``offload/modeling/structure.py``); what a deep copy
takes from the model itself; ``share_memory()``. References are the plain ``nn.Sequential``.
"""

from __future__ import annotations

import copy
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn

from offload import OffloadModel

EXACT = {"rtol": 0.0, "atol": 0.0}
FIXED = "cut its layers into slices when it was built"


class Block(nn.Module):
    """A layer with a submodule of its own, to replace from outside."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), Block(10), nn.ReLU(), Block(10), nn.Tanh(), nn.Linear(10, 3))


def pair(**kwargs):
    plain = small()
    return plain, OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3, **kwargs)


def grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: p.grad for name, p in module.named_parameters()}


def assert_same_run(model: nn.Module, plain: nn.Module, x: torch.Tensor) -> None:
    """Outputs and every gradient of one step equal the plain model's, bit for bit."""
    got, want = model(x), plain(x)
    torch.testing.assert_close(got, want, **EXACT)
    got.square().sum().backward()
    want.square().sum().backward()
    got_grads, want_grads = grads(model), grads(plain)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, **EXACT, msg=name)


def _descend(net: nn.Module) -> None:
    """One step of plain gradient descent, in place, as an optimizer writes the host copies."""
    with torch.no_grad():
        for p in net.parameters():
            p.sub_(0.1 * p.grad)


# -- the layers, read as nn.Sequential reads them ---------------------------------------------------


def test_indexing_length_and_iteration_give_the_layers_as_nn_sequential_does():
    plain, model = pair()
    layers = list(model._modules.values())
    assert len(model) == len(plain) == 6
    assert list(model) == layers
    for k in range(-6, 6):
        assert model[k] is layers[k]
        assert type(model[k]) is type(plain[k])
    assert model[True] is layers[1]  # any integer, as operator.index takes it
    for bad in (6, -7):
        with pytest.raises(IndexError, match="out of range"):
            model[bad]
        with pytest.raises(IndexError):
            plain[bad]
    for bad in ("0", 1.0):
        with pytest.raises(TypeError):
            model[bad]
        with pytest.raises(TypeError):
            plain[bad]


@pytest.mark.parametrize("part", [slice(1, 3), slice(None, -1), slice(None, None, 2), slice(4, 1, -1)])
def test_a_slice_is_an_nn_sequential_over_the_same_layers_under_their_names(part):
    plain, model = pair()
    got, want = model[part], plain[part]
    assert type(got) is nn.Sequential and list(got._modules) == list(want._modules)
    assert all(a is model._modules[name] for name, a in got._modules.items())
    if len(got) and part.step is None:
        x = torch.randn(4, 6 if part.start in (None, 0) else 10)
        torch.testing.assert_close(got(x), want(x), **EXACT)  # on the host copies, not offloaded


def test_a_model_given_as_a_list_of_slices_indexes_them():
    first, second = nn.Linear(4, 4), nn.Linear(4, 2)
    model = OffloadModel([first, second], device="cpu")
    assert (model[0], model[-1], len(model), list(model)) == (first, second, 2, [first, second])


def test_indexing_reads_the_layers_as_forward_trains_them():
    plain, model = pair()
    x = torch.randn(4, 6)
    for net in (model, plain):
        net(x).sum().backward()
        _descend(net)
    for k in range(len(plain)):
        for (name, p), q in zip(model[k].named_parameters(), plain[k].parameters()):
            torch.testing.assert_close(p, q, **EXACT, msg=f"{k}.{name}")


# -- changes to the top-level layers, refused ---------------------------------------------------------


def _replace(model, layer):
    setattr(model, "5", layer)


def _replace_by_index(model, layer):
    model[5] = layer


def _add(model, layer):
    model.add_module("6", layer)


def _register(model, layer):
    model.register_module("6", layer)


def _assign_new_name(model, layer):
    model.head = layer


def _set_none(model, layer):
    setattr(model, "5", None)


def _set_parameter_over_a_layer(model, layer):
    setattr(model, "5", nn.Parameter(torch.zeros(3)))


def _delete(model, layer):
    delattr(model, "4")


def _delete_by_index(model, layer):
    del model[4]


@pytest.mark.parametrize("change, message", [
    (_replace, "setting layer '5'"),
    (_replace_by_index, r"setting model\[5\]"),
    (_add, "adding layer '6'"),
    (_register, "adding layer '6'"),
    (_assign_new_name, "adding layer 'head'"),
    (_set_none, "setting layer '5'"),
    (_set_parameter_over_a_layer, "setting layer '5'"),
    (_delete, "deleting layer '4'"),
    (_delete_by_index, r"deleting model\[4\]"),
])
def test_a_top_level_layer_set_added_or_deleted_after_wrapping_is_refused(change, message):
    # Before the refusal forward ran the layers cut at construction while parameters() and
    # state_dict() showed the new ones: an optimizer trained tensors forward never used.
    plain, model = pair()
    keys = list(model.state_dict())
    with pytest.raises(RuntimeError, match=f"{FIXED}.*{message}.*wrap it again"):
        change(model, nn.Linear(10, 7))
    assert list(model.state_dict()) == keys and len(model) == 6
    assert_same_run(model, plain, torch.randn(4, 6))


def test_a_layer_changed_in_modules_directly_is_refused_at_the_next_forward():
    # torch.ao.quantization.convert swaps modules this way, past __setattr__.
    plain, model = pair()
    model._modules["5"] = nn.Linear(10, 7)
    with pytest.raises(RuntimeError, match=f"{FIXED}.*changing layer\\(s\\) '5' in model._modules"):
        model(torch.randn(4, 6))
    del model._modules["5"]
    with pytest.raises(RuntimeError, match="changing layer\\(s\\) '5'"):
        model(torch.randn(4, 6))
    model._modules["5"] = model._engine.slices[-1].layers[-1]  # put back: runs again
    model._modules["extra"] = nn.ReLU()
    with pytest.raises(RuntimeError, match="changing layer\\(s\\) 'extra'"):
        model(torch.randn(4, 6))
    del model._modules["extra"]
    assert_same_run(model, plain, torch.randn(4, 6))


def test_setting_a_layer_to_itself_and_what_is_not_a_layer_still_works():
    plain, model = pair()
    setattr(model, "5", model[5])
    model.add_module("0", model[0])
    model.config = {"name": "mine"}  # plain attributes, parameters and buffers on the model itself
    model.register_buffer("step", torch.tensor(3))
    model.temperature = nn.Parameter(torch.tensor(2.0))
    del model.config, model.step
    plain.temperature = nn.Parameter(torch.tensor(2.0))
    assert_same_run(model, plain, torch.randn(4, 6))


def test_the_advised_rewrap_with_a_new_head_equals_the_plain_model_with_it():
    plain, model = pair()
    torch.manual_seed(7)
    head = nn.Linear(10, 7)
    plain[5] = copy.deepcopy(head)
    layers = OrderedDict(model.named_children())
    layers["5"] = head
    rewrapped = OffloadModel(nn.Sequential(layers), device="cpu", num_slices=3)
    assert list(rewrapped.state_dict()) == list(plain.state_dict())
    assert_same_run(rewrapped, plain, torch.randn(4, 6))


# -- changes inside a layer, followed ------------------------------------------------------------------


def test_a_submodule_replaced_inside_a_layer_is_followed():
    plain, model = pair()
    x = torch.randn(4, 6)
    model(x)  # laid out and run once before the change
    torch.manual_seed(5)
    first, second = nn.Linear(10, 10), nn.Linear(10, 10)
    plain[1].lin, model[1].lin = copy.deepcopy(first), first
    setattr(plain.get_submodule("3"), "lin", copy.deepcopy(second))
    setattr(model.get_submodule("3"), "lin", second)
    assert_same_run(model, plain, x)
    assert model[1].lin.weight.grad is not None and model[3].lin.weight.grad is not None


# -- deep copies -------------------------------------------------------------------------------------


def _scaled(module, args, output):
    return output * 10.0 + module.temperature


def _marker(module, state, prefix, local_metadata):
    state[prefix + "marker"] = torch.tensor(1)


def _dressed(net: nn.Module) -> nn.Module:
    """``net`` with state registered on the model itself, as an EMA copy or a trainer's wrapper
    finds it: a forward hook, a buffer, a parameter, a plain attribute, a state_dict hook."""
    net.register_buffer("step", torch.tensor(5))
    net.temperature = nn.Parameter(torch.tensor(2.0))
    net.config = {"name": "mine"}
    net.register_forward_hook(_scaled)
    net._register_state_dict_hook(_marker)
    return net


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_what_was_registered_on_the_model_itself(how):
    plain, model = pair(num_microbatches=2)
    _dressed(plain), _dressed(model)
    copied = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}[how]
    twin, plain_twin = copied(model), copy.deepcopy(plain)
    assert twin.config == plain_twin.config and twin.config is not model.config
    assert list(twin.state_dict()) == list(plain_twin.state_dict())
    assert dict(twin.named_buffers()).keys() == dict(plain_twin.named_buffers()).keys()
    assert twin.partition == model.partition and twin.num_microbatches == 2
    x = torch.randn(4, 6)
    torch.testing.assert_close(twin(x), model(x), **EXACT)
    torch.testing.assert_close(twin(x), plain_twin(x), **EXACT)
    with torch.no_grad():
        twin.temperature.add_(1.0)  # a copy's own tensors
    assert model.temperature.item() == 2.0


def test_a_tensor_held_by_the_model_and_a_layer_stays_one_tensor_in_the_copy():
    plain, model = pair()
    model.tied = model[0].weight  # the same parameter, registered on the model too
    twin = copy.deepcopy(model)
    assert twin.tied is twin[0].weight and twin.tied is not model.tied
    twin(torch.randn(4, 6)).sum().backward()
    assert twin.tied.grad is not None and model.tied.grad is None


def test_an_ema_copy_trains_apart_and_follows_by_lerp_as_the_plain_ones():
    plain, model = pair()
    ema, plain_ema = copy.deepcopy(model), copy.deepcopy(plain)
    x = torch.randn(4, 6)
    for net in (model, plain):
        net(x).square().sum().backward()
        _descend(net)
    with torch.no_grad():
        for (shadow, live), (plain_shadow, plain_live) in zip(zip(ema.parameters(), model.parameters()),
                                                              zip(plain_ema.parameters(), plain.parameters())):
            shadow.lerp_(live, 0.5)
            plain_shadow.lerp_(plain_live, 0.5)
    torch.testing.assert_close(ema(x), plain_ema(x), **EXACT)


# -- share_memory ----------------------------------------------------------------------------------------


def test_share_memory_is_refused_and_leaves_the_model_as_it_was():
    # Before the refusal it moved every host copy to shared memory, and the next forward laid them
    # out again unshared: a Hogwild child's updates never reached the parent.
    plain, model = pair()
    pointers = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"share_memory\(\) cannot put.*process_group=.*share the plain"):
        model.share_memory()
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert not any(p.is_shared() for p in model.parameters())
    assert_same_run(model, plain, torch.randn(4, 6))


def test_a_copy_or_pickle_of_a_compiled_model_runs_itself() -> None:
    """model.compile() keeps a compiled call on the model, which nn.Module leaves out of its state:
    a deep copy that kept it would run the original (an EMA copy answering with the live model),
    and a pickle would fail on it."""
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device="cpu", num_slices=2)
    model.compile(backend="eager")
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = model(x)
        twin = copy.deepcopy(model)
        for p in twin.parameters():
            p.zero_()
        assert torch.equal(twin(x), torch.zeros(3, 2))
        assert torch.equal(model(x), want)
        loaded = pickle.loads(pickle.dumps(model))
        assert torch.equal(loaded(x), want)
