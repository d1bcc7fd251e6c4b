"""``estimate_memory`` under a compute dtype keeps the parameters of batch and instance norms in their
own dtype, as ``OffloadModel`` keeps them (``FLOAT32_LAYERS`` in ``offload/streams/host_storage.py``):
a slice of them alone casts nothing (no shadow, no masters' file, its gradients in RAM), and a slice
holding one among other layers has a larger slot and a smaller shadow than if it were cast."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from offload import DiskTier, OffloadModel, OffloadOptimizer, estimate_memory
from offload.model import engine_of
from offload.planning.planner import slice_layout
from offload.streams.host_storage import FLOAT32_LAYERS

#: Each a model of three layers, the middle one a norm whose parameters keep float32, and the
#: input it takes.
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "batchnorm1d": (lambda: nn.Linear(16, 256), lambda: nn.BatchNorm1d(256), lambda: torch.randn(4, 16)),
    "batchnorm2d": (lambda: nn.Conv2d(3, 64, 3, padding=1), lambda: nn.BatchNorm2d(64),
                    lambda: torch.randn(2, 3, 8, 8)),
    "instancenorm2d": (lambda: nn.Conv2d(3, 64, 3, padding=1), lambda: nn.InstanceNorm2d(64, affine=True),
                       lambda: torch.randn(2, 3, 8, 8)),
}


def network(name: str) -> nn.Sequential:
    first, norm, _ = MODELS[name]
    torch.manual_seed(0)
    layer = first()
    last = nn.Linear(256, 16) if isinstance(layer, nn.Linear) else nn.Conv2d(64, 3, 3, padding=1)
    return nn.Sequential(layer, norm(), last)


BUILT = ("masters", "shadows", "disk_window")
STEPPED = ("masters", "shadows", "gradients", "optimizer_state", "disk_window")


@pytest.mark.parametrize("masters", ["ram", "disk"])
@pytest.mark.parametrize("num_slices", [3, 2], ids=["norm-alone", "norm-mixed"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_estimate_keeps_a_norms_parameters_in_their_dtype_as_the_model_does(name, num_slices, masters, tmp_path):
    """Per category, after the model is built and after it has stepped; and which slices cast."""
    plan = estimate_memory(network(name), num_slices=num_slices, compute_dtype=torch.bfloat16, device="cpu",
                           masters=masters)
    layout = slice_layout(network(name), num_slices=num_slices, compute_dtype=torch.bfloat16)
    layers = network(name)
    model = OffloadModel(layers, device="cpu", num_slices=num_slices, compute_dtype=torch.bfloat16,
                         masters=DiskTier(tmp_path) if masters == "disk" else None)
    assert isinstance(layers[1], FLOAT32_LAYERS) and layers[1].weight.dtype == torch.float32
    alone = num_slices == 3
    assert model.partition[1] == (("1",) if alone else ("1", "2"))
    # The norm's slice casts nothing when it is alone; mixed, the layer beside it casts.
    assert [s.storage.shadow is not None for s in engine_of(model).slices] == layout.casts == [True, not alone, True][
        :num_slices]

    def check(categories: tuple[str, ...]) -> None:
        footprint = model.memory_footprint()
        for category in categories:
            assert plan.host_categories()[category] == footprint.host_categories()[category], category
        assert plan.device_slots == footprint.device_slots and plan.disk == footprint.disk

    check(BUILT)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-3, fused=True)
    for _ in range(2):
        model(MODELS[name][2]()).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    optimizer.synchronize()
    check(STEPPED)
    optimizer.close()


def test_a_slice_of_a_norm_alone_sizes_the_slots_in_its_own_dtype():
    """The largest slice is a batch norm's: the slots hold its parameters in float32, and it has no
    shadow; the layer after it casts."""
    def layers() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.BatchNorm1d(4096), nn.Linear(4096, 1))

    plan = estimate_memory(layers(), num_slices=2, compute_dtype=torch.bfloat16, device="cpu")
    model = OffloadModel(layers(), device="cpu", num_slices=2, compute_dtype=torch.bfloat16)
    footprint = model.memory_footprint()
    norm = 2 * 4096 * 4 + 2 * 4096 * 4  # weight and bias, running mean and variance: float32
    assert footprint.device_slots == plan.device_slots > 2 * norm
    assert footprint.host_shadows == plan.host_shadows < 4096 * 4


def test_the_slice_layout_counts_a_norms_gradients_in_their_own_dtype():
    """What a slice's backward computes on the device: the norm's gradients in float32, the
    linear layers' in the compute dtype."""
    layout = slice_layout(network("batchnorm1d"), num_slices=3, compute_dtype=torch.bfloat16)
    assert layout.computed_gradient_bytes == [(16 * 256 + 256) * 2, 2 * 256 * 4, (256 * 16 + 16) * 2]
