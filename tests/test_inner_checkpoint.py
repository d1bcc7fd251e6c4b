"""Layers that checkpoint themselves, and hooks that tell a recompute from a forward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload import OffloadActivations, OffloadModel

from .helpers import DEVICES, assert_same_grads
from .test_mixed_precision import converted, master_grads_of

EXACT = {"rtol": 0.0, "atol": 0.0}


class SelfCheckpointing(nn.Module):
    """Two linear layers whose activations the layer itself recomputes in backward."""

    def __init__(self, width: int = 8, reentrant: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(lambda t: self.b(torch.tanh(self.a(t))), x, use_reentrant=self.reentrant)


def network(reentrant: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[SelfCheckpointing(reentrant=reentrant) for _ in range(4)], nn.Linear(8, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("num_microbatches", [1, 2])
def test_layers_that_checkpoint_themselves_recompute_with_the_device_copies(checkpoint_activation, num_microbatches,
                                                                            device):
    plain = network().to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=5, num_microbatches=num_microbatches,
                         checkpoint_activation=checkpoint_activation)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(2)).to(device)
    for _ in range(2):  # the second step: after an optimizer-like change of the host copies
        plain.zero_grad()
        model.zero_grad()
        plain(x).pow(2).sum().backward()
        model(x).pow(2).sum().backward()
        tol = EXACT if num_microbatches == 1 else {"rtol": 1e-5, "atol": 1e-6}
        assert_same_grads(model, plain, **tol)
        with torch.no_grad():
            for p, q in zip(plain.parameters(), model.parameters()):
                p.sub_(0.1 * p.grad)
                q.sub_(0.1 * q.grad)


def test_the_recompute_inside_a_layer_reads_no_host_copy():
    """On the CPU the host and device copies hold the same float32 values, so only the
    stream-ordering checker sees a layer computing on the host copy."""
    from offload.streamcheck import StreamChecker

    with StreamChecker() as checker:
        model = OffloadModel(network(), device="cpu", num_slices=5)
        model(torch.randn(3, 8)).sum().backward()
    assert not checker.races, checker.summary()


def test_two_forwards_then_backwards_of_kept_graphs_that_checkpoint_inside():
    plain = network()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=5, checkpoint_activation=False)
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    first, second = model(x), model(y)  # the slots now hold other slices than the first forward's
    (first.sum() + second.pow(2).sum()).backward()
    (plain(x).sum() + plain(y).pow(2).sum()).backward()
    assert_same_grads(model, plain, **EXACT)


def test_self_checkpointing_layers_under_a_compute_dtype():
    plain = network()
    reference = converted(plain, torch.bfloat16)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=5, compute_dtype=torch.bfloat16)
    x = torch.randn(4, 8)
    reference(x.to(torch.bfloat16)).float().pow(2).sum().backward()
    model(x).float().pow(2).sum().backward()
    assert_same_grads(model, master_grads_of(reference), **EXACT)


def test_reentrant_checkpointing_inside_a_layer_gets_advice_naming_it():
    model = OffloadModel(network(reentrant=True), device="cpu", num_slices=5)
    # An input that requires grad: the reentrant form differentiates only through its inputs, so
    # with a plain input its outputs require no grad and backward never reaches it (as in the plain model).
    with pytest.raises(RuntimeError, match=r"slice \d \(\d\) uses torch.utils.checkpoint with use_reentrant=True"):
        model(torch.randn(3, 8, requires_grad=True)).sum().backward()
    # The model is usable afterwards.
    for k in range(4):
        model.get_submodule(str(k)).reentrant = False
    model(torch.randn(3, 8)).sum().backward()


@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("offloaded", [None, [1]], ids=["", "slice_1_offloaded"])
def test_forward_hooks_fire_again_in_recompute_and_can_tell(checkpoint_activation, offloaded):
    policy = None if offloaded is None else OffloadActivations(slices=offloaded, min_bytes=0)
    model = OffloadModel([nn.Linear(4, 4) for _ in range(3)], device="cpu", checkpoint_activation=checkpoint_activation,
                         offload_activations=policy)
    calls: dict[int, list[bool]] = {k: [] for k in range(3)}
    for k in range(3):
        model.get_submodule(str(k)).register_forward_hook(lambda m, i, o, k=k: calls[k].append(offload.is_recomputing()))
    assert not offload.is_recomputing()
    model(torch.randn(2, 4)).sum().backward()
    if checkpoint_activation and offloaded:
        # Slice 0 is recomputed; slice 1's saved tensors come back from the host, nothing reruns.
        assert calls == {0: [False, True], 1: [False], 2: [False]}
    elif checkpoint_activation:
        # Slices 0 and 1 are recomputed; the last slice's graph is kept from forward.
        assert calls == {0: [False, True], 1: [False, True], 2: [False]}
    else:
        assert calls == {0: [False], 1: [False], 2: [False]}
