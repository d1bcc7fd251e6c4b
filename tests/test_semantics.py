"""PyTorch's autograd and nn.Module semantics keep working through OffloadModel."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.utils._python_dispatch
from torch import nn

from offload import OffloadModel

from .helpers import ACTIVATIONS, DEVICES, assert_same_grads, clone_model, microbatched_reference, seeded

EXACT = {"rtol": 0.0, "atol": 0.0}


def small(dropout: float = 0.0) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 10), nn.ReLU(), nn.Dropout(dropout), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3)
    )


def pair(device: str, dropout: float = 0.0, **kwargs):
    torch.manual_seed(0)
    reference = small(dropout).to(device)
    kwargs.setdefault("num_slices", 3)
    return reference, OffloadModel(clone_model(reference), device=device, **kwargs)


# -- gradients through autograd ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_accumulate_across_backward_calls(device):
    reference, model = pair(device)
    x1, x2 = torch.randn(4, 6, device=device), torch.randn(5, 6, device=device)
    for net in (reference, model):
        net(x1).sum().backward()
        net(x2).pow(2).sum().backward()
    assert_same_grads(model, reference, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_several_forwards_before_one_backward(device, activations):
    reference, model = pair(device, dropout=0.2, **ACTIVATIONS[activations])
    xs = [torch.randn(4, 6, device=device) for _ in range(3)]

    def losses(net):
        return [net(x).pow(2).sum() for x in xs]

    ref_losses = seeded(1, lambda: losses(reference))
    off_losses = seeded(1, lambda: losses(model))
    for loss_ref, loss_off in zip(ref_losses, off_losses):
        torch.testing.assert_close(loss_off, loss_ref, **EXACT)
    # Backward in a different order than forward: each call carries its own state.
    for k in (1, 0, 2):
        ref_losses[k].backward()
        off_losses[k].backward()
    assert_same_grads(model, reference, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_retain_graph_twice_doubles_and_third_backward_raises(device, activations):
    reference, model = pair(device, **ACTIVATIONS[activations])
    x = torch.randn(4, 6, device=device)
    loss_ref, loss_off = reference(x).sum(), model(x).sum()
    loss_ref.backward(retain_graph=True)
    loss_ref.backward()
    loss_off.backward(retain_graph=True)
    loss_off.backward()
    assert_same_grads(model, reference, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss_ref.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss_off.backward()


@pytest.mark.parametrize("retain_graph", [False, True])
def test_a_loss_kept_past_its_backward_keeps_no_run_records_unless_the_graph_is_retained(retain_graph):
    # A loop that keeps each step's loss (losses.append(loss)) keeps its graph: its checkpointed runs'
    # records (generator states, snapshots) go with the backward that used them, as a kept graph's do.
    _, model = pair("cpu", dropout=0.2, num_microbatches=2)
    x = torch.randn(4, 6)
    output = model(x)
    records = output.grad_fn.run.records
    kept = [weakref.ref(record) for row in records.grid for record in row]
    assert len(kept) == 6 and records._last_library is None  # forward over: no run left to compare with
    output.sum().backward(retain_graph=retain_graph)
    gc.collect()
    assert [ref() is not None for ref in kept] == [retain_graph] * 6
    if retain_graph:  # the records serve the second backward
        first = [p.grad.clone() for p in model.parameters()]
        output.sum().backward()
        for p, g in zip(model.parameters(), first):
            torch.testing.assert_close(p.grad, 2 * g, **EXACT)


def test_a_backward_again_after_one_that_raised_part_way_says_what_pytorch_says():
    _, model = pair("cpu", num_microbatches=2)
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    first.register_full_backward_hook(lambda *_: (_ for _ in ()).throw(ValueError("a hook's error")))
    loss = model(torch.randn(4, 6, requires_grad=True)).sum()
    with pytest.raises(ValueError, match="a hook's error"):
        loss.backward()
    with pytest.raises(RuntimeError, match=r"^Trying to backward through the graph a second time.*retain_graph=True"):
        loss.backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_autograd_grad_wrt_input_leaves_dot_grad_untouched(device, activations):
    reference, model = pair(device, **ACTIVATIONS[activations])
    x_ref = torch.randn(4, 6, device=device, requires_grad=True)
    x_off = x_ref.detach().clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(reference(x_ref).pow(2).sum(), x_ref)
    (g_off,) = torch.autograd.grad(model(x_off).pow(2).sum(), x_off)
    torch.testing.assert_close(g_off, g_ref, **EXACT)
    assert x_off.grad is None
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_autograd_grad_wrt_parameters_and_input(device, activations):
    reference, model = pair(device, **ACTIVATIONS[activations])
    x_ref = torch.randn(4, 6, device=device, requires_grad=True)
    x_off = x_ref.detach().clone().requires_grad_()
    ref_params, off_params = list(reference.parameters()), list(model.parameters())
    picks = [0, 3, 5]
    g_ref = torch.autograd.grad(reference(x_ref).sum(), [x_ref] + [ref_params[k] for k in picks])
    g_off = torch.autograd.grad(model(x_off).sum(), [x_off] + [off_params[k] for k in picks])
    for a, b in zip(g_off, g_ref):
        torch.testing.assert_close(a.to(b.device), b, **EXACT)
    assert all(p.grad is None for p in model.parameters())
    assert x_off.grad is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_backward_with_inputs_fills_only_those_grads(device, activations):
    reference, model = pair(device, **ACTIVATIONS[activations])
    x = torch.randn(4, 6, device=device)
    last_ref, last_off = list(reference.parameters())[-1], list(model.parameters())[-1]
    reference(x).sum().backward(inputs=[last_ref])
    model(x).sum().backward(inputs=[last_off])
    torch.testing.assert_close(last_off.grad.to(device), last_ref.grad, **EXACT)
    assert all(p.grad is None for p in list(model.parameters())[:-1])


@pytest.mark.parametrize("device", DEVICES)
def test_grad_tensors_for_non_scalar_output(device):
    reference, model = pair(device)
    x = torch.randn(4, 6, device=device)
    weights = torch.randn(4, 3, device=device)
    reference(x).backward(weights)
    model(x).backward(weights)
    assert_same_grads(model, reference, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_parameter_hooks_fire_once_per_backward(device, activations):
    _, model = pair(device, **ACTIVATIONS[activations])
    calls: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    post: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: post.append(name))
    model(torch.randn(4, 6, device=device)).sum().backward()
    assert calls == {name: 1 for name, _ in model.named_parameters()}
    assert sorted(post) == sorted(name for name, _ in model.named_parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_stay_the_same_objects_on_the_offload_device(device):
    torch.manual_seed(0)
    plain = small().to(device)
    originals = list(plain.parameters())
    model = OffloadModel(plain, device=device, num_slices=2)
    assert [id(p) for p in model.parameters()] == [id(p) for p in originals]
    assert all(p.device.type == "cpu" for p in model.parameters())
    model(torch.randn(3, 6, device=device)).sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters())
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_parameters_get_no_gradient(device):
    reference, model = pair(device)
    for net in (reference, model):
        for p in list(net.parameters())[:2]:
            p.requires_grad_(False)
    x = torch.randn(4, 6, device=device)
    reference(x).sum().backward()
    model(x).sum().backward()
    assert_same_grads(model, reference, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("zeroed", [False, True])
@pytest.mark.parametrize("which", [0, -2])  # a recomputed slice's weight, the last slice's (its graph kept)
def test_a_parameter_frozen_between_forward_and_backward_gets_no_gradient(device, zeroed, which):
    # Autograd's accumulation skips a leaf that no longer requires grad: its .grad stays as it was,
    # None, or the zeros of zero_grad(set_to_none=False), which backward would otherwise add into.
    reference, model = pair(device)
    x = torch.randn(4, 6, device=device)
    if zeroed:
        for net in (reference, model):
            net(x).sum().backward()
            net.zero_grad(set_to_none=False)
    outputs = [net(x).pow(2).sum() for net in (reference, model)]
    for net in (reference, model):
        list(net.parameters())[which].requires_grad_(False)
    for loss in outputs:
        loss.backward()
    assert_same_grads(model, reference, **EXACT)
    frozen = list(model.parameters())[which]
    assert (frozen.grad is None) if not zeroed else bool((frozen.grad == 0).all())


OUTSIDE = "used a parameter that requires grad .* that is not registered in its layers"


@pytest.mark.parametrize("mode", ["recompute", "keep", "offload"])
@pytest.mark.parametrize("where", [0, 3])  # a layer of the first slice, of the last
def test_a_parameter_captured_by_a_hook_is_refused_not_left_without_a_gradient(mode, where):
    # The plain model gives the hook's parameter a gradient; backward differentiates each slice with
    # respect to its own registered parameters only (Note: [Leaves outside the slice]).
    from offload import OffloadActivations

    options = {"keep": {"checkpoint_activation": False},
               "offload": {"offload_activations": OffloadActivations(slices=[0, 1, 2], min_bytes=0)}}.get(mode, {})
    _, model = pair("cpu", **options)
    scale = nn.Parameter(torch.tensor(1.5))
    model._modules[str(where)].register_forward_hook(lambda module, args, out: out * scale)
    with pytest.raises(RuntimeError, match=OUTSIDE) as raised:
        model(torch.randn(4, 6))
    assert "shape ()" in str(raised.value)
    scale.requires_grad_(False)  # what needs no gradient may be captured
    reference = small()
    reference.load_state_dict(model.state_dict())
    reference[where].register_forward_hook(lambda module, args, out: out * scale)
    x = torch.randn(4, 6)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(model, reference, **EXACT)


@pytest.mark.parametrize("num_slices", [1, 2])
def test_a_frozen_embeddings_output_made_a_leaf_inside_the_slice_is_not_refused(num_slices):
    # What enable_input_require_grads() does (PEFT's prepare_model_for_kbit_training, Hugging Face's
    # gradient checkpointing): a leaf made during the run, whose gradient the plain model never reads.
    def build() -> nn.Sequential:
        torch.manual_seed(0)
        embedding = nn.Embedding(10, 8)
        embedding.weight.requires_grad_(False)
        embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))
        return nn.Sequential(embedding, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    reference, model = build(), OffloadModel(build(), device="cpu", num_slices=num_slices)
    ids = torch.randint(0, 10, (4, 5))
    reference(ids).pow(2).sum().backward()
    model(ids).pow(2).sum().backward()
    assert_same_grads(model, reference, **EXACT)


def test_another_layers_weight_referenced_directly_is_refused_and_tied_it_trains():
    class Head(nn.Module):
        def __init__(self, embedding: nn.Embedding, tie: bool) -> None:
            super().__init__()
            if tie:
                self.weight = embedding.weight  # registered here too: loaded with this slice
            else:
                self.__dict__["embedding"] = embedding  # a plain reference the walk cannot see

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            weight = self.weight if "weight" in self._parameters else self.embedding.weight
            return h @ weight.t()

    def build(tie: bool) -> nn.Sequential:
        torch.manual_seed(0)
        embedding = nn.Embedding(10, 8)
        return nn.Sequential(embedding, nn.Linear(8, 8), nn.Tanh(), Head(embedding, tie))

    ids = torch.randint(0, 10, (4, 5))
    with pytest.raises(RuntimeError, match=OUTSIDE):
        OffloadModel(build(False), device="cpu", num_slices=3)(ids)
    reference = build(True)
    model = OffloadModel(clone_model(reference), device="cpu", num_slices=3)
    model(ids).logsumexp(-1).sum().backward()
    reference(ids).logsumexp(-1).sum().backward()
    assert_same_grads(model, reference, **EXACT)


@pytest.mark.parametrize("device", DEVICES)
def test_unused_parameter_gets_no_gradient(device):
    class TakesFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.unused = nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), TakesFirst(), nn.Linear(4, 2)).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=3)
    x = torch.randn(3, 4, device=device)
    reference(x).sum().backward()
    model(x).sum().backward()
    assert_same_grads(model, reference, **EXACT)
    assert model._modules["1"].unused.weight.grad is None


# -- nn.Module behaviour ----------------------------------------------------------------------------


def test_state_dict_keys_match_and_checkpoints_move_both_ways():
    torch.manual_seed(0)
    plain = small()
    model = OffloadModel(clone_model(plain), device="cpu", num_slices=2)
    assert list(model.state_dict()) == list(plain.state_dict())

    other = small()
    model.load_state_dict(other.state_dict())
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), other(x), **EXACT)

    fresh = small()
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh(x), model(x), **EXACT)


def test_train_and_eval_switch_dropout():
    torch.manual_seed(0)
    model = OffloadModel(small(dropout=0.5), device="cpu", num_slices=2)
    x = torch.randn(8, 6)
    model.eval()
    assert not any(m.training for m in model.modules())
    torch.testing.assert_close(model(x), model(x), **EXACT)
    model.train()
    assert all(m.training for m in model.modules())
    assert not torch.equal(model(x), model(x))


def test_memory_footprint_accounts_for_host_copies_slots_and_pool():
    model = OffloadModel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)), device="cpu",
                         num_slices=3, compute_dtype=torch.bfloat16)
    before = model.memory_footprint()
    layer_bytes = (64 * 64 + 64) * 4
    assert before.host_copies >= 3 * layer_bytes and before.host_copies < 3 * layer_bytes + 3 * 256
    assert before.host_shadows >= 3 * layer_bytes // 2
    assert before.device_slots >= 2 * layer_bytes // 2 and before.host_pool == 0 and not before.pinned
    assert before.pinned_bytes == 0
    model(torch.randn(4, 64)).float().sum().backward()
    after = model.memory_footprint()
    assert after.host_pool > 0 and after.host_gradients >= 3 * layer_bytes
    assert after.host_total == sum(after.host_categories().values())
    assert "host_gradients" in str(after) and f"{after.parameters:,} parameters" in str(after)


@pytest.mark.parametrize("device", DEVICES)
def test_deepcopy_makes_an_independent_model_cut_the_same_way(device):
    torch.manual_seed(0)
    model = OffloadModel(small(dropout=0.1), device=device, num_slices=3, num_microbatches=2,
                         compute_dtype=torch.bfloat16)
    model.eval()
    twin = copy.deepcopy(model)
    assert twin.partition == model.partition and not twin.training
    assert (twin.num_microbatches, twin.compute_dtype, twin.device) == (2, torch.bfloat16, model.device)
    assert all(p is not q for p, q in zip(twin.parameters(), model.parameters()))
    x = torch.randn(4, 6, device=device)
    torch.testing.assert_close(twin(x), model(x), **EXACT)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    assert not torch.equal(twin(x), model(x))  # independent storage
    twin.train()
    twin(x).float().sum().backward()
    assert all(p.grad is not None for p in twin.parameters()) and all(p.grad is None for p in model.parameters())


def test_repr_and_partition_show_the_slices():
    model = OffloadModel(small(), device="cpu", num_slices=3)
    assert model.partition == (("0", "1", "2"), ("3", "4"), ("5",))
    text = repr(model)
    assert "slices=[0..2:" in text and "[5:" in text and "checkpoint_activation=True" in text


@pytest.mark.parametrize("device", DEVICES)
def test_loading_a_new_parameter_object_or_data_is_followed(device):
    reference, model = pair(device)
    x = torch.randn(3, 6, device=device)
    model(x)  # slots now hold the old values
    with torch.no_grad():
        new_weight = torch.randn(10, 6)
    model._modules["0"].weight.data = new_weight.clone()
    reference._modules["0"].weight.data = new_weight.clone().to(device)
    torch.testing.assert_close(model(x), reference(x), **EXACT)
    model._modules["5"].bias = nn.Parameter(torch.ones(3))
    reference._modules["5"].bias = nn.Parameter(torch.ones(3, device=device))
    torch.testing.assert_close(model(x), reference(x), **EXACT)
    model(x).sum().backward()
    assert model._modules["5"].bias.grad is not None


class Adapted(nn.Module):
    """A layer with a module injected around it after wrapping, as adapter libraries do."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.extra = nn.Linear(base.out_features, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.extra(self.base(x))


@pytest.mark.parametrize("device", DEVICES)
def test_modules_added_to_a_layer_after_wrapping_are_laid_out(device):
    reference, model = pair(device)
    x = torch.randn(3, 6, device=device)
    model(x)
    storage = model._engine.slices[0].storage
    flat = storage.flat
    nn.Linear(2, 2)  # registrations elsewhere: looked at, nothing to lay out again
    model(x)
    assert storage.flat is flat
    torch.manual_seed(1)
    model._modules["3"].inner = Adapted(nn.Linear(10, 10))  # a new submodule of a wrapped layer
    torch.manual_seed(1)
    reference._modules["3"].inner = Adapted(nn.Linear(10, 10)).to(device)
    for layers in (model, reference):
        layers._modules["3"].register_forward_hook(lambda module, args, out: module.inner(out))
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(model, reference, rtol=0, atol=0)
    assert len(model._engine.parameters()) == len(list(reference.parameters()))


def test_dtype_conversion_is_followed_and_the_host_copies_stay():
    torch.manual_seed(0)
    reference = small().double()
    model = OffloadModel(small(), device="cpu", num_slices=2)
    model.load_state_dict(reference.state_dict())  # copies into float32 host copies
    model.double()
    assert all(p.dtype == torch.float64 for p in model.parameters())
    x = torch.randn(3, 6, dtype=torch.float64)
    torch.testing.assert_close(model(x), reference(x), **EXACT)
    model.to("meta")  # moves the compute device only (tests/test_placement.py)
    assert model.device == torch.device("meta")
    assert all(p.device.type == "cpu" and p.dtype == torch.float64 for p in model.parameters())


# -- boundaries and inputs --------------------------------------------------------------------------


class Pair(nn.Module):
    """Returns a tuple: the next layer receives it as one argument, as in nn.Sequential."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)

    def forward(self, x):
        return self.a(x), [self.b(x), {"scale": 0.5, "mask": (x > 0)}]


class Merge(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Linear(5, 5)

    def forward(self, inputs):
        a, (b, extra) = inputs
        return self.c(a * extra["scale"] + b * extra["mask"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_nested_tuple_boundaries(device, num_microbatches):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(5, 5), Pair(), Merge(), nn.Linear(5, 2)).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=4, num_microbatches=num_microbatches)
    x_ref = torch.randn(6, 5, device=device, requires_grad=True)
    x_off = x_ref.detach().clone().requires_grad_()
    reference(x_ref).pow(2).sum().backward()
    model(x_off).pow(2).sum().backward()
    torch.testing.assert_close(x_off.grad, x_ref.grad, rtol=1e-6, atol=1e-7)
    assert_same_grads(model, reference, rtol=1e-6, atol=1e-7)


class AddMask(nn.Module):
    """Takes (x, mask) where mask goes whole to every microbatch and requires grad."""

    def forward(self, inputs):
        x, bias = inputs
        return x + bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [1, 3])
def test_tuple_input_with_a_shared_tensor(device, num_microbatches):
    torch.manual_seed(0)
    reference = nn.Sequential(AddMask(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=2, num_microbatches=num_microbatches)
    x = torch.randn(6, 4, device=device, requires_grad=True)
    bias = torch.randn(4, device=device, requires_grad=True)  # no batch dimension: goes whole
    x2, bias2 = x.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()
    out_ref = reference((x, bias))
    out_off = model((x2, bias2))
    assert out_off.shape == (6, 1)
    out_ref.pow(2).sum().backward()
    out_off.pow(2).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(bias2.grad, bias.grad, rtol=1e-6, atol=1e-6)
    assert_same_grads(model, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_integer_token_ids_into_an_embedding(device, num_microbatches):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 50)).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=3, num_microbatches=num_microbatches)
    tokens = torch.randint(0, 50, (4, 7), device=device)
    targets = torch.randint(0, 50, (4, 7), device=device)
    for net in (reference, model):
        logits = net(tokens)
        nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert_same_grads(model, reference, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_host_input_with_device_compute(device):
    reference, model = pair(device)
    x_host = torch.randn(4, 6, requires_grad=True)
    out = model(x_host)
    assert out.device.type == torch.device(device).type
    out.sum().backward()
    assert x_host.grad is not None and x_host.grad.device.type == "cpu"
    x_ref = x_host.detach().to(device).requires_grad_()
    reference(x_ref).sum().backward()
    torch.testing.assert_close(x_host.grad, x_ref.grad.cpu(), **EXACT)


@pytest.mark.parametrize("device", DEVICES)
def test_fewer_rows_than_microbatches_uses_one_microbatch_per_row(device):
    reference, model = pair(device, num_microbatches=8)
    x = torch.randn(3, 6, device=device)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-6, atol=1e-7)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(model, reference, rtol=1e-6, atol=1e-7)


def test_output_without_batch_dimension_cannot_be_joined_across_microbatches():
    class Summarise(nn.Module):
        def forward(self, x):
            return x.sum()

    model = OffloadModel(nn.Sequential(nn.Linear(3, 3), Summarise()), device="cpu", num_slices=2, num_microbatches=2)
    with pytest.raises(ValueError, match="batch dimension"):
        model(torch.randn(4, 3))
    single = OffloadModel(nn.Sequential(nn.Linear(3, 3), Summarise()), device="cpu", num_slices=2)
    assert single(torch.randn(4, 3)).shape == ()


@pytest.mark.parametrize("device", DEVICES)
def test_output_rows_other_than_the_batch_with_one_microbatch(device):
    class Flatten(nn.Module):
        def forward(self, x):
            return x.reshape(-1, x.shape[-1])  # (batch, seq, vocab) -> (batch * seq, vocab)

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 20), Flatten()).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=3)
    tokens = torch.randint(0, 20, (3, 5), device=device)
    targets = torch.randint(0, 20, (15,), device=device)
    for net in (reference, model):
        nn.functional.cross_entropy(net(tokens), targets).backward()
    assert_same_grads(model, reference, **EXACT)


class Aliasing(nn.Module):
    """Returns outputs that share memory: the input twice, the input and a view of it, or a dict
    that lists a view before its base (Note: [Outputs that alias each other] in offload/autograd/call.py)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        if self.kind == "same":
            return x, x
        if self.kind == "view":
            return x, x[:, :2]
        if self.kind == "flat":
            return x, x.flatten()
        if self.kind == "swapped":  # a base that is not contiguous, rows first, and a view of it
            swapped = x.view(-1, 2, 2).transpose(1, 2)
            return swapped, swapped[:, :1]
        return {"head": x[..., 1], "all": x, "rest": (x[:, 2:],)}


def _aliasing_outputs(net, x, num_microbatches, offloaded):
    """The outputs' leaves, base first, after an in-place change of the base and then of a view."""
    if offloaded or num_microbatches == 1:
        out = net(x)
    else:  # the plain layers on each microbatch, joined before the last layer (all of them exact)
        out = net[-1](torch.cat([net[:-1](chunk) for chunk in x.tensor_split(num_microbatches)]))
    leaves = list(out) if isinstance(out, tuple) else [out["all"], out["head"], out["rest"][0]]
    leaves[0].mul_(2)
    leaves[-1].add_(1)
    return leaves


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("kind", ["same", "view", "dict"])
def test_outputs_that_alias_each_other_behave_as_in_pytorch(kind, num_microbatches, activations):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4), Aliasing(kind))
    model = OffloadModel(clone_model(reference), device="cpu", num_slices=2, num_microbatches=num_microbatches,
                         **ACTIVATIONS[activations])
    x_ref = torch.randn(6, 6, requires_grad=True)
    x_off = x_ref.detach().clone().requires_grad_()
    ref = _aliasing_outputs(reference, x_ref, num_microbatches, offloaded=False)
    off = _aliasing_outputs(model, x_off, num_microbatches, offloaded=True)
    for got, want in zip(off, ref):
        torch.testing.assert_close(got, want, **EXACT)  # each in-place change reached the others
    assert [a is b for a in off for b in off] == [a is b for a in ref for b in ref]
    for leaves in (ref, off):
        sum(leaf.pow(2).sum() for leaf in leaves[1:]).backward()
    torch.testing.assert_close(x_off.grad, x_ref.grad, **EXACT)
    assert_same_grads(model, reference, **EXACT)


def test_a_view_that_does_not_carry_over_joined_microbatches_is_an_output_of_its_own():
    """A view of a base laid out otherwise than the joined one (a transposed base): rule 3 joins it
    as an output of its own, as before views were rebuilt: the plain model's values and gradients,
    exact unless one of the two is changed in place. One that cannot be joined at all is refused by
    the join, as every output that does not carry the batch dimension is."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 4), Aliasing("swapped"))
    model = OffloadModel(clone_model(reference), device="cpu", num_slices=2, num_microbatches=2)
    x = torch.randn(6, 6)
    want = reference[-1](torch.cat([reference[:-1](chunk) for chunk in x.tensor_split(2)]))
    got = model(x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **EXACT)
    for out in (got, want):
        sum(o.pow(2).sum() for o in out).backward()
    assert_same_grads(model, reference, **EXACT)
    flat = OffloadModel(nn.Sequential(nn.Linear(6, 4), Aliasing("flat")), device="cpu", num_slices=1,
                        num_microbatches=2)
    with pytest.raises(ValueError, match="does not carry the batch dimension"):
        flat(x)


# -- no graph ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode_keep_nothing(device, mode):
    reference, model = pair(device, dropout=0.3)
    x = torch.randn(4, 6, device=device)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        out_ref = seeded(2, lambda: reference(x))
        out_off = seeded(2, lambda: model(x))
    torch.testing.assert_close(out_off, out_ref, **EXACT)
    assert out_off.grad_fn is None and not out_off.requires_grad
    # And training afterwards still works.
    model(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class Transposed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_without_a_graph_layers_see_parameters_that_require_grad_as_the_plain_models(device, mode):
    # torch.matmul folds a non-contiguous 3-D input into one product only for a weight that
    # requires no grad (it reads the flag, not the grad mode): the plain model's parameters keep
    # theirs under no_grad, and the copies the layers run with must too, or they round otherwise.
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), Transposed(), nn.Linear(8, 8), Transposed()).to(device)
    reference[2].requires_grad_(False)  # and a frozen one stays frozen
    model = OffloadModel(copy.deepcopy(reference), device=device, num_slices=2)
    seen = []
    for layer in (model[2], model[0]):
        layer.register_forward_pre_hook(lambda m, i: seen.append(m.weight.requires_grad))
    x = torch.randn(4, 5, 8, device=device).transpose(0, 1)  # into the trainable layer, as into the frozen one
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        torch.testing.assert_close(model(x), reference(x), **EXACT)
    assert seen == [True, False]


@pytest.mark.parametrize("device", DEVICES)
def test_no_parameter_requires_grad_runs_without_graph(device):
    _, model = pair(device)
    model.requires_grad_(False)
    out = model(torch.randn(2, 6, device=device))
    assert out.grad_fn is None


# -- layers with state ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_batchnorm_running_stats_update_once_per_forward(device, activations):
    torch.manual_seed(0)
    reference = nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)
    ).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=3, **ACTIVATIONS[activations])
    for _ in range(3):
        x = torch.randn(6, 4, device=device)
        reference(x).pow(2).sum().backward()
        model(x).pow(2).sum().backward()
    for (name, b_off), b_ref in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(b_off.to(device), b_ref, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert_same_grads(model, reference, rtol=1e-5, atol=1e-6)
    assert int(model._modules["1"].num_batches_tracked) == 3
    model.eval()
    reference.eval()
    x = torch.randn(5, 4, device=device)
    torch.testing.assert_close(model(x), reference(x), rtol=1e-6, atol=1e-6)


class Counter(nn.Module):
    """A layer whose output depends on a buffer it updates: recompute must see the old value."""

    def __init__(self, in_place: bool = True):
        super().__init__()
        self.in_place = in_place
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        if self.in_place:
            self.count += 1
        else:
            # Same values without the in-place write, so the plain model can run several chunks
            # in one graph (in place, PyTorch itself refuses: the saved count was modified).
            self.count = self.count + 1
        return x * self.count


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_microbatches", [1, 3])
def test_buffer_updated_in_forward_is_restored_for_recompute(device, num_microbatches):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 3), Counter(), nn.Linear(3, 3), Counter(), nn.Linear(3, 1)).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=3, num_microbatches=num_microbatches)
    for layer in reference:
        if isinstance(layer, Counter):
            layer.in_place = num_microbatches == 1
    for _ in range(2):
        x = torch.randn(6, 3, device=device)
        out_ref = microbatched_reference(reference, model.partition, x, num_microbatches)
        out_off = model(x)
        torch.testing.assert_close(out_off, out_ref, **EXACT)
        out_ref.sum().backward()
        out_off.sum().backward()
    assert float(model._modules["1"].count) == float(reference._modules["1"].count) == 2 * num_microbatches
    assert_same_grads(model, reference, rtol=1e-5, atol=1e-6)


class Reassigns(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps = self.steps + 1  # reassignment, not in place
        return x + self.steps


def test_reassigned_buffer_is_written_back():
    model = OffloadModel(nn.Sequential(nn.Linear(2, 2), Reassigns(), nn.Linear(2, 1)), device="cpu", num_slices=3)
    for _ in range(3):
        model(torch.randn(2, 2)).sum().backward()
    assert float(model._modules["1"].steps) == 3.0


@pytest.mark.parametrize("device", DEVICES)
def test_lstm_returning_a_tuple(device):
    class LastStep(nn.Module):
        def forward(self, inputs):
            output, _ = inputs
            return output[:, -1]

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 6), nn.LSTM(6, 6, batch_first=True), LastStep(), nn.Linear(6, 2)).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=3)
    x = torch.randn(4, 5, 3, device=device)
    reference(x).sum().backward()
    model(x).sum().backward()
    assert_same_grads(model, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_tied_weights_inside_one_slice(device):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(4, 4, bias=False)
            self.second = nn.Linear(4, 4, bias=False)
            self.second.weight = self.first.weight

        def forward(self, x):
            return self.second(torch.tanh(self.first(x)))

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), Tied(), nn.Linear(4, 1)).to(device)
    model = OffloadModel(clone_model(reference), device=device, num_slices=3)
    x = torch.randn(3, 4, device=device)
    reference(x).sum().backward()
    model(x).sum().backward()
    assert_same_grads(model, reference, rtol=1e-6, atol=1e-7)
    tied = model._modules["1"]
    assert tied.first.weight is tied.second.weight


def test_layer_returning_its_own_weight_gets_a_copy():
    class Emits(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            return self.table  # aliases the device copy

    model = OffloadModel(nn.Sequential(nn.Linear(3, 3), Emits(), nn.Linear(3, 3), nn.Linear(3, 3)),
                         device="cpu", num_slices=4)
    with torch.no_grad():
        out = model(torch.randn(3, 3))
    expected = model._modules["3"](model._modules["2"](model._modules["1"].table))
    torch.testing.assert_close(out, expected, **EXACT)


# -- mixed precision tools ------------------------------------------------------------------------


def test_grad_scaler_with_host_gradients_and_cpu_autocast():
    torch.manual_seed(0)
    reference = small()
    model = OffloadModel(clone_model(reference), device="cpu", num_slices=3)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10) for _ in range(2)]
    optims = [torch.optim.SGD(net.parameters(), lr=0.05) for net in (reference, model)]
    for step in range(3):
        x = torch.randn(4, 6)
        for net, scaler, opt in zip((reference, model), scalers, optims):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    for p_off, p_ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p_off, p_ref, **EXACT)
    assert scalers[0].get_scale() == scalers[1].get_scale()


def test_grad_scaler_skips_the_step_on_overflow():
    torch.manual_seed(0)
    model = OffloadModel(small(), device="cpu", num_slices=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 6)
    x[0, 0] = float("inf")
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)
    scaler.update()
    for p, p0 in zip(model.parameters(), before):
        assert torch.equal(p, p0)
    assert scaler.get_scale() == 2.0**7


# -- edges of autograd found in review --------------------------------------------------------------


def test_double_backward_is_refused_with_a_clear_error():
    _, model = pair("cpu")
    x = torch.randn(3, 6, requires_grad=True)
    out = model(x)
    with pytest.raises(RuntimeError, match="does not support double backward"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_callers_saved_tensor_hooks_do_not_see_internal_state(activations):
    reference, model = pair("cpu", **ACTIVATIONS[activations])
    x = torch.randn(4, 6)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    assert packed == []
    with torch.autograd.graph.save_on_cpu():
        loss = model(x).pow(2).sum()
    loss.backward()
    out.pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    assert_same_grads(model, reference, rtol=1e-6, atol=1e-7)


class KeepsWeakref(nn.Module):
    """Remembers its output weakly: the test checks graphs that never see backward are freed."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.last = None

    def forward(self, x):
        import weakref

        y = torch.tanh(self.linear(x))  # tanh saves its own output for backward
        self.last = weakref.ref(y)
        return y


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_kept_graphs_without_backward_are_freed(activations):
    import gc

    model = OffloadModel(nn.Sequential(nn.Linear(6, 6), KeepsWeakref(), KeepsWeakref()), device="cpu",
                         num_slices=3, **ACTIVATIONS[activations])
    out = model(torch.randn(2, 6))  # e.g. a validation pass with grad enabled
    del out
    gc.collect()
    assert model._modules["2"].last() is None
    assert model._modules["1"].last() is None
    loss = model(torch.randn(2, 6)).sum()
    loss.backward(retain_graph=True)
    del loss
    gc.collect()
    assert model._modules["2"].last() is None


class ScalesInPlace(nn.Module):
    def forward(self, x):
        return x.mul_(2)


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_in_place_change_of_a_saved_tensor_raises_as_in_pytorch(activations):
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Sigmoid(), ScalesInPlace())

    plain = build()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain(torch.randn(2, 4)).sum().backward()
    model = OffloadModel(build(), device="cpu", num_slices=2, **ACTIVATIONS[activations])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(torch.randn(2, 4)).sum().backward()


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_in_place_on_the_output_behaves_as_in_pytorch(activations):
    reference, model = pair("cpu", **ACTIVATIONS[activations])  # last layer: Linear
    x = torch.randn(4, 6)
    for net in (reference, model):
        y = net(x)
        y.relu_()
        y.sum().backward()
    assert_same_grads(model, reference, **EXACT)
    sigmoid_last = OffloadModel(nn.Sequential(nn.Linear(6, 6), nn.Sigmoid()), device="cpu", num_slices=2,
                                **ACTIVATIONS[activations])
    y = sigmoid_last(x)
    y.mul_(2)  # sigmoid saved its output: PyTorch refuses this backward, and so do we
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("num_microbatches", [1, 2, 3])
@pytest.mark.parametrize("input_on_host", [False, True], ids=["input_on_device", "input_on_host"])
def test_slice_starting_with_an_in_place_layer(device, activations, num_microbatches, input_on_host):
    # Every slice starts with a layer that writes its input in place; the first one writes the model's
    # input, which needs no gradient, each microbatch its own rows of it, and a kept graph saves what
    # each wrote (Note: [Chunks with a version counter of their own] in offload/walk/microbatch.py).
    torch.manual_seed(0)
    first = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(5, 5), nn.Linear(5, 5))
    second = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(5, 5))
    third = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(5, 1))
    reference = nn.Sequential(first, second, third).to(device)
    model = OffloadModel([clone_model(first), clone_model(second), clone_model(third)], device=device,
                         **ACTIVATIONS[activations], num_microbatches=num_microbatches)
    model.to(torch.float32)  # no-op conversion; the layers are on the offload device now
    x = torch.randn(6, 5, device=device)
    x_reference = x.clone()
    x_model = x.cpu().clone() if input_on_host else x.clone()
    reference(x_reference).pow(2).sum().backward()
    model(x_model).pow(2).sum().backward()
    assert_same_grads(model, reference, **(EXACT if num_microbatches == 1 else {"rtol": 1e-6, "atol": 1e-7}))
    if x_model.device == x_reference.device:  # written as in the plain model (a host input is loaded: a copy)
        torch.testing.assert_close(x_model, x_reference, **EXACT)
        assert x_model._version == x_reference._version


@pytest.mark.parametrize("device", DEVICES)
def test_frozen_model_gradient_of_the_input_only(device):
    reference, model = pair(device)
    for net in (reference, model):
        net.requires_grad_(False)
    x_ref = torch.randn(4, 6, device=device, requires_grad=True)
    x_off = x_ref.detach().clone().requires_grad_()
    reference(x_ref).pow(2).sum().backward()
    model(x_off).pow(2).sum().backward()
    torch.testing.assert_close(x_off.grad, x_ref.grad, **EXACT)


class _WatchWeightCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Keeps weak references to the bfloat16 casts autocast makes of 32 x 32 weights."""

    def __init__(self):
        super().__init__()
        self.casts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16
                and tuple(out.shape) == (32, 32)):
            self.casts.append(weakref.ref(out))
        return out


@pytest.mark.parametrize("checkpoint", [True, False])
def test_autocast_keeps_no_half_precision_weights_of_checkpointed_slices(checkpoint):
    # Autocast caches its cast of a weight that requires grad until the outermost autocast block
    # ends; a checkpointed slice must not leave its weights' casts on the device that long.
    torch.manual_seed(0)
    model = OffloadModel(nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)]), device="cpu", num_slices=6,
                         checkpoint_activation=checkpoint)
    watch = _WatchWeightCasts()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with watch:
            out = model(torch.randn(4, 32))
        gc.collect()
        alive = sum(ref() is not None for ref in watch.casts)
        # Without checkpointing every slice keeps its graph, and the graph its cast, as in the plain
        # model; with it only the last slice does (it stays resident into backward).
        assert alive == (1 if checkpoint else 6), alive
        recomputed = len(watch.casts)
        with watch:  # a backward inside the autocast block: the recompute casts again
            out.float().sum().backward()
        del out
        gc.collect()
        assert len(watch.casts) > recomputed or not checkpoint
        alive = sum(ref() is not None for ref in watch.casts[recomputed:])
        assert alive == 0, alive


class _Twice(nn.Module):
    """One weight used twice: under autocast the plain model casts it once (autocast's cache), and
    the two uses' gradients add up in half precision before the cast back."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(torch.tanh(self.linear(x)))


@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward-inside-autocast", "backward-after"])
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_a_weight_used_twice_under_autocast_gets_the_plain_models_gradient(activations, backward_inside):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 16), _Twice(), nn.Linear(16, 16), _Twice())
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2, **ACTIVATIONS[activations])
    x = torch.randn(8, 16)
    for net in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net(x).float().square().sum()
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    assert_same_grads(model, plain, rtol=0, atol=0)


# -- layers that differentiate inside their forward (Note: [Layers that differentiate in forward]) --


class _Force(nn.Module):
    """A force from an energy: the layer differentiates a graph it builds in its own forward."""

    def __init__(self, create_graph: bool):
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.create_graph = create_graph

    def forward(self, x):
        with torch.enable_grad():
            inside = x if x.requires_grad else x.detach().requires_grad_()
            energy = torch.tanh(self.linear(inside)).pow(2).sum()
            (force,) = torch.autograd.grad(energy, inside, create_graph=self.create_graph)
        return x - force


def _forces_in_early_slices(create_graph: bool) -> nn.Sequential:
    # Slices [0, 1], [2, 3], [4, 5]: slice 0's slot is loaded with other slices before its backward.
    torch.manual_seed(0)
    return nn.Sequential(_Force(create_graph), nn.Linear(6, 6), _Force(create_graph), nn.Tanh(), nn.Linear(6, 6),
                         nn.Tanh())


def _force_in_last_slice() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), _Force(True), nn.Tanh())


def _assert_matches_plain(plain: nn.Sequential, **kwargs) -> None:
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3, **kwargs)
    x = torch.randn(8, 6)
    x_plain, x_model = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_plain, out_model = plain(x_plain), model(x_model)
    out_plain.pow(2).sum().backward()
    out_model.pow(2).sum().backward()
    torch.testing.assert_close(out_model, out_plain, **EXACT)
    torch.testing.assert_close(x_model.grad, x_plain.grad, **EXACT)
    assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_layer_differentiating_in_forward_matches_the_plain_model_with_kept_graphs(num_microbatches):
    # A graph built from a resolved slot tensor (create_graph=True) saves it again; loading the
    # slot with another slice is no in-place change of it.
    for create_graph in (True, False):
        plain = _forces_in_early_slices(create_graph)
        if num_microbatches == 1:
            _assert_matches_plain(plain, checkpoint_activation=False)
            continue
        model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3, checkpoint_activation=False,
                             num_microbatches=num_microbatches)
        x = torch.randn(8, 6)
        out = model(x)
        torch.testing.assert_close(out, microbatched_reference(plain, model.partition, x, num_microbatches), **EXACT)
        out.pow(2).sum().backward()  # no "modified by an inplace operation"


@pytest.mark.parametrize("activations", ["recompute", "offload_last", "offload_all"])
def test_a_layer_differentiating_in_forward_is_refused_where_forward_keeps_nothing(activations):
    model = OffloadModel(_forces_in_early_slices(True), device="cpu", num_slices=3, **ACTIVATIONS[activations])
    with pytest.raises(RuntimeError, match=r"^OffloadModel: a layer .*differentiated, inside its forward.*"
                       r"checkpoint_activation=False") as caught:
        model(torch.randn(8, 6, requires_grad=True))
    if hasattr(caught.value, "add_note"):  # Python 3.11+: the note names the layer and its slice
        assert "in layer 0 (_Force) of OffloadModel slice 0" in caught.value.__notes__
    # What the error says to do works; with one microbatch the last slice keeps its graph in every mode.
    _assert_matches_plain(_forces_in_early_slices(True), checkpoint_activation=False)
    _assert_matches_plain(_force_in_last_slice(), **ACTIVATIONS[activations])


class _FuncGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x):
        return torch.func.vmap(torch.func.grad(lambda row: torch.tanh(self.linear(row)).pow(2).sum()))(x)


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_torch_func_grad_in_a_layer_gets_a_note_saying_what_to_use(activations):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), _FuncGrad())
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=1, **ACTIVATIONS[activations])
    x = torch.randn(8, 6)
    with pytest.raises(RuntimeError, match="saved tensor hooks") as caught:
        model(x)
    if hasattr(caught.value, "add_note"):  # Python 3.11+
        notes = "\n".join(caught.value.__notes__)
        assert "saved-tensor hooks" in notes and "torch.autograd.grad" in notes
        assert "checkpoint_activation=False" in notes
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), **EXACT)
