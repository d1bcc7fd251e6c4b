"""A parameter whose gradient comes sparse (``nn.Embedding(sparse=True)``) takes no room in the
gradient buffers (Note: [Sparse gradients take no room] in ``offload/streams/gradient_places.py``).

Its indices and values travel in a pooled buffer of their own, so the host landing buffers and,
with several microbatches, the device buffers that sum them hold the dense gradients alone: a
sparse embedding laid out at its dense size took that much room for nothing in each. Training is
bit for bit the plain model's, a dense gradient that such a weight receives all the same (read
densely by another operation of its layer) travels apart, and the planner counts what the model
holds, its model profile included.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from offload import DiskTier, OffloadModel, OffloadOptimizer, estimate_memory
from offload.planning.shapes import profile_layers
from offload.streams.flat_views import _align
from offload.streams.gradient_places import lay_out_gradients, sparse_entries
from offload.streams.slice_entries import collect_entries

EXACT = {"rtol": 0.0, "atol": 0.0}
ROWS = 20_000  # the embedding's dense gradient (5.12 MB) dwarfs the linears' (33 KB at most)


def lookup_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(ROWS, 64, sparse=True), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64),
                         nn.Tanh(), nn.Linear(64, 8))


def ids(step: int) -> torch.Tensor:
    return torch.randint(0, ROWS, (4, 8), generator=torch.Generator().manual_seed(step))


def dense_need(model: OffloadModel) -> list[int]:
    """Per slice, the bytes its dense gradients take laid out one after the other (the sparse
    embedding's none)."""
    return [sum(_align(e.shape.numel() * e.dtype.itemsize) for e in s.storage.params
                if e.tensor.requires_grad and not isinstance(e.sites[0].module, nn.Embedding))
            for s in model._engine.slices]


def assert_buffers_hold_only_dense_gradients(model: OffloadModel, num_microbatches: int) -> None:
    need = dense_need(model)
    pooled = [b.data.numel() for b in model._engine.pool.buffers()]
    # The largest is a landing buffer: the largest slice's dense gradients (the others are boundary
    # activations and the embedding's indices and values, a few KB).
    assert max(pooled) == max(need), (pooled, need)
    device = model._engine.gradients.device_nbytes
    if num_microbatches == 1:
        assert device == 0
    else:  # two buffers, each as large as the largest slice that summed in it
        assert max(need) <= device <= 2 * max(need), (device, need)


@pytest.mark.parametrize("masters", ["ram", "disk"])
@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize("num_slices", [1, 3], ids=["beside-dense-layers", "alone-in-its-slice"])
def test_the_gradient_buffers_hold_the_dense_gradients_alone(num_slices, num_microbatches, masters, tmp_path):
    model = OffloadModel(lookup_model(), device="cpu", num_slices=num_slices, num_microbatches=num_microbatches,
                         compute_dtype=torch.bfloat16, masters=DiskTier(tmp_path) if masters == "disk" else None)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=1e-2)
    for step in range(3):  # from the first backward on (GradientOffloader.expect)
        model(ids(step)).float().sum().backward()
        assert_buffers_hold_only_dense_gradients(model, num_microbatches)
        assert model.get_parameter("0.weight").grad.is_sparse
        optimizer.step()
        optimizer.zero_grad(set_to_none=step % 2 == 0)
    optimizer.synchronize()


OPTIMIZERS = [
    pytest.param(torch.optim.SGD, {"lr": 0.1}, id="SGD"),
    pytest.param(torch.optim.Adagrad, {"lr": 0.1}, id="Adagrad"),
    pytest.param(torch.optim.SparseAdam, {"lr": 0.1}, id="SparseAdam"),
]


def _stepped(model: nn.Module, optimizer_class: type) -> list[nn.Parameter]:
    """SparseAdam takes sparse gradients only: the embedding; the others every parameter."""
    if optimizer_class is torch.optim.SparseAdam:
        return [p for name, p in model.named_parameters() if name.startswith("0.")]
    return list(model.parameters())


@pytest.mark.parametrize("resident", [0, 1], ids=["streamed", "resident"])
@pytest.mark.parametrize("num_microbatches", [1, 2])
@pytest.mark.parametrize(("optimizer_class", "kwargs"), OPTIMIZERS)
def test_training_equals_the_plain_model_bit_for_bit(optimizer_class, kwargs, num_microbatches, resident):
    plain = lookup_model()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3, num_microbatches=num_microbatches,
                         resident_slices=resident)
    reference = optimizer_class(_stepped(plain, optimizer_class), **kwargs)
    optimizer = OffloadOptimizer(model, optimizer_class, _stepped(model, optimizer_class), **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "SGD is stepping|Adagrad is stepping")
        for step in range(3):
            for rows in ids(step).tensor_split(num_microbatches):  # as each slice sums its microbatches
                plain(rows).square().sum().backward()
            model(ids(step)).square().sum().backward()
            assert_buffers_hold_only_dense_gradients(model, num_microbatches)
            reference.step()
            optimizer.step()
            # Kept .grad: the dense gradients land in buffers of the largest slice's size.
            reference.zero_grad(set_to_none=False)
            optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, **EXACT, msg=name)


class LookupReadDensely(nn.Module):
    """An embedding built with ``sparse=True`` whose weight another operation of the layer reads
    too: autograd sums the two gradients into a dense one."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 6, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding(x) + self.embedding.weight.mean(0)


@pytest.mark.parametrize("masters", ["ram", "disk"])
@pytest.mark.parametrize("resident", [0, 1], ids=["streamed", "resident"])
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_a_dense_gradient_of_a_weight_laid_out_as_sparse_travels_apart(num_microbatches, resident, masters,
                                                                         tmp_path):
    torch.manual_seed(0)
    plain = nn.Sequential(LookupReadDensely(), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 3))
    settings = {"device": "cpu", "num_slices": 2, "num_microbatches": num_microbatches, "resident_slices": resident}
    if masters == "disk":  # which needs a compute dtype: against the same model with its masters in RAM
        settings["compute_dtype"] = torch.bfloat16
        reference: nn.Module = OffloadModel(copy.deepcopy(plain), **settings)
        model = OffloadModel(copy.deepcopy(plain), masters=DiskTier(tmp_path), **settings)
    else:
        reference, model = plain, OffloadModel(copy.deepcopy(plain), **settings)
    # The guess from where the weight is registered: sparse, so its place takes no room.
    assert sparse_entries(model._engine.slices[0].storage.params) == [True]
    for step in range(3):  # the second and third add into .grad (zero_grad never runs)
        x = torch.randint(0, 12, (4, 5), generator=torch.Generator().manual_seed(step))
        if reference is plain:
            for rows in x.tensor_split(num_microbatches):
                plain(rows).square().sum().backward()
        else:
            reference(x).float().square().sum().backward()
        model(x).float().square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.grad.layout == torch.strided, name
            if step == 0 or num_microbatches == 1 or reference is not plain:  # else: summed in another order
                torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=name)
            else:
                torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_place_laid_out_as_sparse_takes_no_room_and_is_never_viewed():
    params, _ = collect_entries([nn.Embedding(100, 8, sparse=True), nn.Linear(8, 4)])
    places, nbytes = lay_out_gradients(params, [True] * 3, [True, False, False])
    assert nbytes == _align(8 * 4 * 4) + _align(4 * 4)
    assert places[0] is not None and places[0].sparse and not places[1].sparse
    with pytest.raises(AssertionError, match="a place that takes no room"):
        places[0].view(torch.empty(nbytes, dtype=torch.uint8))


@pytest.mark.parametrize(("compute_dtype", "masters"),
                         [(None, "ram"), (torch.bfloat16, "ram"), (torch.bfloat16, "disk")],
                         ids=["fp32", "bf16", "bf16-masters-on-disk"])
def test_the_estimate_matches_the_footprint(compute_dtype, masters, tmp_path):
    plain = lookup_model()
    plan = estimate_memory(plain, num_slices=3, compute_dtype=compute_dtype, optimizer="sgd", device="cpu",
                           masters=masters)
    model = OffloadModel(plain, device="cpu", num_slices=3, compute_dtype=compute_dtype,
                         masters=DiskTier(tmp_path) if masters == "disk" else None)
    optimizer = OffloadOptimizer(model, torch.optim.SGD, lr=1e-2)
    for step in range(2):
        model(ids(step)).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the sparse .grad is left empty
    optimizer.synchronize()
    footprint = model.memory_footprint()
    for category in ("masters", "shadows", "gradients", "optimizer_state", "disk_window"):
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    assert plan.disk == footprint.disk
    # The pool also keeps what the planner was not told about: boundary activations (4 x 8 x 64
    # values a slice) and the embedding's indices and values (32 of each).
    others = 3 * 4 * 8 * 64 * 4 + 32 * (2 * 8 + 64 * 4)
    pooled = footprint.host_pool_idle + footprint.host_activations
    assert plan.host_pool_idle <= pooled <= plan.host_pool_idle + others


def test_profile_layers_and_the_estimate_with_it_run_on_a_sparse_embedding():
    plain = lookup_model()
    profile = profile_layers(plain, lambda: ids(0))
    # The embedding's backward makes a sparse gradient: its indices and values are counted.
    assert len(profile.layers) == len(plain)
    plan = estimate_memory(plain, num_slices=3, optimizer="sgd", device="cpu", profile=profile)
    assert plan.device_activations > 0
