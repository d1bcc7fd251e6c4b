"""Tensors whose memory is another tensor's: taken in with a warning, or, for a call's substitutes,
copied and left as they are.

See Note: [Tensors that view another's memory] and Note: [Tensors substituted for a call] in
``offload/streams/host_storage.py``.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.nn.utils.stateless import _reparametrize_module

from offload import OffloadModel
from offload.streams.host_storage import SliceStorage

from .helpers import DEVICES, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}
#: What the warning says, as a ``pytest.warns`` match and a ``-W error:...`` filter take it.
VIEWED = "viewed memory that another tensor holds"


def mlp(n: int = 2, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(n) for m in (nn.Linear(width, width), nn.Tanh())])


def pair(n: int = 2, device: str = "cpu", **settings) -> tuple[nn.Sequential, OffloadModel]:
    plain = mlp(n).to(device)
    return plain, OffloadModel(copy.deepcopy(plain).cpu(), device=device, num_slices=2, **settings)


def batch(seed: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(device)


def flatten(model: nn.Module) -> nn.Parameter:
    """The flat-parameter pattern: every parameter's ``.data`` (and ``.grad``) a view of one buffer,
    which the optimizer steps."""
    params = list(model.parameters())
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    flat.grad = torch.zeros_like(flat)
    offset = 0
    for p in params:
        p.data = flat.data[offset:offset + p.numel()].view_as(p)
        p.grad = flat.grad[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


@contextlib.contextmanager
def no_warning_about_views() -> Iterator[None]:
    """A block in which the warning fails the test."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{VIEWED}")
        yield


# -- taken in, with a warning ----------------------------------------------------------------


def test_flat_parameters_are_named_in_one_warning_at_the_next_forward():
    _, model = pair()
    flatten(model)
    with pytest.warns(UserWarning, match=VIEWED) as caught:
        model(batch(0))
    messages = [str(w.message) for w in caught if VIEWED in str(w.message)]
    assert len(messages) == 1
    assert "parameter '0.weight' (Linear) and 3 more" in messages[0]
    assert "will not reach the model" in messages[0] and "model.parameters()" in messages[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(batch(1))  # said once
        flatten(model)  # again: the model already said it
        model(batch(2))


def test_vector_to_parameters_then_edits_of_the_vector_warn():
    _, model = pair()
    vector = parameters_to_vector(model.parameters()) * 0.5
    vector_to_parameters(vector, model.parameters())
    with pytest.warns(UserWarning, match=r"parameter '0\.weight' \(Linear\) and 3 more " + VIEWED):
        model(batch(0))
    # What the warning says: the vector is no longer the model's.
    before = model(batch(1)).detach()
    vector.mul_(2)
    torch.testing.assert_close(model(batch(1)).detach(), before, **EXACT)


def test_a_model_built_over_views_warns_when_wrapped():
    plain = mlp()
    flatten(plain)
    with pytest.warns(UserWarning, match=VIEWED):
        OffloadModel(plain, device="cpu", num_slices=2)


def test_a_buffer_registered_as_a_view_is_named_as_a_buffer():
    plain = mlp()
    table = torch.arange(16.0)
    plain[0].register_buffer("scale", table[:8])
    with pytest.warns(UserWarning, match=r"buffer '0\.scale' \(Linear\) " + VIEWED):
        OffloadModel(plain, device="cpu", num_slices=2)


def test_a_resident_slice_warns_too():
    _, model = pair(resident_slices=1)
    flatten(model)
    with pytest.warns(UserWarning, match=r"parameter '0\.weight' \(Linear\) and 3 more " + VIEWED):
        model(batch(0))


def test_the_models_own_paths_do_not_warn():
    with no_warning_about_views():
        plain, model = pair(n=3)
        model(batch(0)).sum().backward()
        model[0].weight.data = torch.randn(8, 8)  # a fresh tensor
        model[2].weight = nn.Parameter(torch.randn(8, 8))  # a new parameter
        model[4].weight = model[0].weight  # tied across slices
        model.load_state_dict(model.state_dict())
        model.apply(lambda m: nn.init.zeros_(m.bias) if isinstance(m, nn.Linear) else None)
        model.double()
        model(batch(1).double()).sum().backward()
        model[2].weight.data = model[2].weight.data.t()  # a view of memory nothing else holds
        model(batch(2).double())
        plain[0].register_buffer("position_ids", torch.arange(8).expand(1, -1))  # an expanded view
        OffloadModel(plain, device="cpu", num_slices=2, resident_slices=1)(batch(3))


# -- a call's substitutes, left as they are ---------------------------------------------------


def views_of_one_base(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    base = torch.zeros(sum(p.numel() for p in model.parameters()))
    views, offset = {}, 0
    for name, p in model.named_parameters():
        views[name] = base[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return base, views


def test_functional_call_leaves_the_callers_tensors_as_they_are():
    _, model = pair()
    base, views = views_of_one_base(model)
    base.copy_(torch.randn(base.shape, generator=torch.Generator().manual_seed(3)))
    address = {name: view.data_ptr() for name, view in views.items()}
    with no_warning_about_views(), torch.no_grad():
        functional_call(model, views, (batch(0),))
    assert {name: view.data_ptr() for name, view in views.items()} == address
    assert all(view._base is base for view in views.values())
    base.fill_(1.0)
    assert all(bool((view == 1).all()) for view in views.values())


def test_a_resident_slice_takes_substitutes_in_with_the_warning():
    _, model = pair(resident_slices=1)
    _, views = views_of_one_base(model)
    with pytest.warns(UserWarning, match=r"parameter '0\.weight' \(Linear\) and 1 more " + VIEWED), torch.no_grad():
        functional_call(model, views, (batch(0),))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("leaves", [True, False], ids=["leaves", "computed"])
def test_functional_call_outputs_and_gradients_are_bit_identical(device, checkpoint_activation, leaves):
    plain, model = pair(device=device, checkpoint_activation=checkpoint_activation)
    results = []
    for module in (plain, model):
        source = {name: p.detach().cpu().clone().requires_grad_() for name, p in plain.named_parameters()}
        # Leaves, or fast weights computed from them (non-leaf tensors, as MAML passes).
        given = source if leaves else {name: t * 0.5 + 0.1 for name, t in source.items()}
        given = {name: t.to(device) if module is plain else t for name, t in given.items()}
        address = {name: t.data_ptr() for name, t in given.items()}
        out = functional_call(module, given, (batch(0, device),))
        out.pow(2).sum().backward()
        assert {name: t.data_ptr() for name, t in given.items()} == address
        results.append((out.detach().cpu(), {name: t.grad for name, t in source.items()}))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, **EXACT)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **EXACT)
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(model(batch(1, device)), plain(batch(1, device)), **EXACT)  # its own again


def test_a_substitute_changed_in_place_is_followed_within_the_call():
    plain, model = pair()
    results = []
    for module in (plain, model):
        base, views = views_of_one_base(module)
        base.copy_(parameters_to_vector(plain.parameters()).detach())
        leaves = {name: view.detach().clone().requires_grad_() for name, view in views.items()}
        optimizer = torch.optim.SGD(leaves.values(), lr=0.1, fused=True)
        outputs = []
        with _reparametrize_module(module, views), torch.no_grad():
            outputs.append(module(batch(0)))
            base.mul_(0.5)  # through the base
            outputs.append(module(batch(0)))
            views["0.weight"].data.add_(1.0)  # through .data: no version counter counts it
            outputs.append(module(batch(0)))
        with _reparametrize_module(module, leaves):
            for step in range(3):  # a fused optimizer (it bumps no version counter) inside one call
                loss = module(batch(step)).pow(2).sum()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                outputs.append(loss.detach())
        results.append(outputs)
    for got, want in zip(*reversed(results)):
        torch.testing.assert_close(got, want, **EXACT)


def test_substitute_buffers_are_taken_in_and_see_the_layers_writes():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    found = []
    for module in (plain, model):
        buffers = {name: b.clone() for name, b in module.named_buffers()}
        params = {name: p.detach().clone().requires_grad_() for name, p in module.named_parameters()}
        functional_call(module, (params, buffers), (x,)).sum().backward()
        found.append((buffers, {name: p.grad for name, p in params.items()}))
    (want_buffers, want_grads), (got_buffers, got_grads) = found
    for name in want_buffers:
        torch.testing.assert_close(got_buffers[name], want_buffers[name], **EXACT)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **EXACT)
    assert_same_grads(model, plain, **EXACT)


def test_a_substitute_holding_nan_is_laid_out_once_per_call(monkeypatch):
    plain, model = pair()
    builds = []
    build = SliceStorage.build

    def counted(storage: SliceStorage) -> None:
        builds.append(storage)
        build(storage)

    monkeypatch.setattr(SliceStorage, "build", counted)
    params = {name: p.detach().clone() for name, p in plain.named_parameters()}
    params["2.bias"][0] = float("nan")  # torch.equal would call it changed at every forward
    params["0.bias"][1] = -0.0
    with torch.no_grad(), _reparametrize_module(model, params):
        got = [model(batch(step)) for step in range(4)]
        laid_out = len(builds)
        params["0.bias"][1] = 0.0  # a sign of zero flipped in place is followed, bit for bit
        got.append(model(batch(4)))
    assert laid_out == 2 and len(builds) == 3  # both slices as the call starts; the first once more
    with torch.no_grad(), _reparametrize_module(plain, params):
        params["0.bias"][1] = -0.0
        want = [plain(batch(step)) for step in range(4)]
        params["0.bias"][1] = 0.0
        want.append(plain(batch(4)))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **EXACT, equal_nan=True)
