"""``estimate_memory(device="cuda")`` counts pinned host buffers as the pool allocates them: each in
its size class (``offload/streams/pinned.py``), the gradient buffers that stay as ``.grad`` too.
Checked on the CPU against the engine's own ``size_class`` and against a model whose pool is given
the size classes it gets on CUDA; on a GPU against the measured footprint."""

from __future__ import annotations

import torch
from torch import nn

import offload.walk.engine as engine_module
from offload import DiskTier, OffloadModel, OffloadOptimizer, estimate_memory
from offload.planning.planner import slice_layout
from offload.streams.host_buffers import HostBufferPool

from .helpers import CUDA, trained

#: A Linear(600, 600)'s float32 gradients: 1,442,400 bytes, between two size classes.
WIDTH = 600


def linears(count: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(count)])


class _Tied(nn.Module):
    """An output head computing with the embedding's weight (tied across slices)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def tied() -> nn.Sequential:
    # The embedding's gradient, 4000 x 80 float32 (1,280,000 bytes), is summed in the head's
    # slice's landing buffer, which its .grad keeps (Note: [A tied weight's gradients summed in place]).
    torch.manual_seed(0)
    embedding = nn.Embedding(4000, 80)
    return nn.Sequential(embedding, nn.Linear(80, 80), nn.Tanh(), nn.Linear(80, 80), _Tied(embedding))


class _SizedPool(HostBufferPool):
    """The pool as the engine builds it where it pins (CUDA): buffers in the size classes."""

    def __init__(self, allocate, size_class=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(allocate, engine_module.size_class)


def test_pinned_gradients_are_counted_in_the_engines_size_classes():
    """Each slice's ``.grad`` keeps its landing buffer, of the size class of its gradients' bytes:
    ``host_gradients``, ``host_pool`` and ``pinned_bytes`` count it so; unpinned, exactly."""
    layout = slice_layout(linears(), num_slices=4)
    exact = estimate_memory(linears(), num_slices=4, device="cpu")
    pinned = estimate_memory(linears(), num_slices=4, device=torch.device("cuda"))
    rounded = [engine_module.size_class(g) for g in layout.gradient_bytes]
    assert all(g < r for g, r in zip(layout.gradient_bytes, rounded))  # each between two classes
    assert exact.host_gradients == sum(layout.gradient_bytes)
    assert pinned.host_gradients == sum(rounded)
    assert pinned.host_pool == sum(rounded) + pinned.host_pool_idle == sum(rounded) + 2 * max(rounded)
    assert pinned.pinned_bytes == pinned.host_masters + pinned.host_shadows + pinned.host_pool
    assert not exact.pinned and exact.pinned_bytes == 0


def test_the_estimate_for_cuda_equals_a_model_whose_pool_has_the_size_classes(monkeypatch):
    """A model on the CPU whose pool rounds as a pinned one does (the only difference the device
    makes to these categories): the gradients kept as ``.grad`` are what the estimate for CUDA
    counts, and the pool the window beside them."""
    monkeypatch.setattr(engine_module, "HostBufferPool", _SizedPool)
    plan = estimate_memory(linears(), num_slices=4, device="cuda")
    model = OffloadModel(linears(), device="cpu", num_slices=4)
    optimizer = trained(model, lambda: torch.randn(2, WIDTH), fused=True)
    footprint = model.memory_footprint()
    optimizer.close()
    assert footprint.host_gradients > 4 * 4 * (WIDTH * WIDTH + WIDTH)
    for category in ("masters", "shadows", "gradients", "optimizer_state"):
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    # The pool also keeps the (small, unrounded) boundary activations the plan was not told about.
    pooled = footprint.host_pool - footprint.host_gradients
    assert plan.host_pool_idle <= pooled <= plan.host_pool_idle + 4 * 2 * WIDTH * 4


def test_with_the_masters_on_disk_a_tied_weights_sum_is_counted_in_its_size_class(monkeypatch, tmp_path):
    """The sum is the head slice's landing buffer, which the embedding's ``.grad`` keeps whole
    (Note: [A tied weight's gradients summed in place]): a pooled buffer, rounded. (Compared with
    that ``.grad``'s storage, not with ``host_gradients`` measured, which also counts the gradient
    files' pages the page cache still holds at that moment.)"""
    monkeypatch.setattr(engine_module, "HostBufferPool", _SizedPool)
    plan = estimate_memory(tied(), num_slices=3, compute_dtype=torch.bfloat16, device="cuda", masters="disk")
    layers = tied()
    model = OffloadModel(layers, device="cpu", num_slices=3, compute_dtype=torch.bfloat16, masters=DiskTier(tmp_path))
    trained(model, lambda: torch.randint(0, 4000, (2, 3)), fused=True).close()
    kept = layers[0].weight.grad.untyped_storage().nbytes()  # the parameter itself: its .grad is the sum
    assert kept == engine_module.size_class(4000 * 80 * 4) > 4000 * 80 * 4
    assert plan.host_gradients == kept


@CUDA
def test_the_estimate_for_cuda_equals_the_pinned_footprint():
    plan = estimate_memory(linears(), num_slices=4, device="cuda")
    model = OffloadModel(linears(), device="cuda", num_slices=4)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    for _ in range(2):
        model(torch.randn(2, WIDTH, device="cuda")).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    footprint = model.memory_footprint()
    assert footprint.pinned and plan.pinned
    for category in ("masters", "shadows", "gradients", "optimizer_state"):
        assert plan.host_categories()[category] == footprint.host_categories()[category], category
    activations = 4 * 2 * WIDTH * 4  # a boundary activation per slice, 2 x 600 float32
    pooled = footprint.host_pool - footprint.host_gradients
    assert plan.host_pool_idle <= pooled <= plan.host_pool_idle + activations
    # Registered mappings are whole pages, small activation buffers the caching allocator's.
    assert plan.pinned_bytes <= footprint.pinned_bytes <= 1.02 * plan.pinned_bytes + 2**20
