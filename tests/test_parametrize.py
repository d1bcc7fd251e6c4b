"""Layers that register a parametrization on their own parameters during forward, and remove it.

PEFT's LoRA on fused mixture-of-experts weights and routers (``lora.ParamWrapper``) does this on
every call. OffloadModel runs layers on device copies of their parameters (``offload/walk/binding.py``);
the round trip must register the device copy back as a parameter, the results must be the plain
model's bit for bit, and no failure may leave the user's modules changed.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from offload import OffloadModel

from .helpers import DEVICES, HostStepped, assert_same_grads

EXACT = {"rtol": 0.0, "atol": 0.0}


class Delta(nn.Module):
    """``w + a @ b``: a low-rank update, as LoRA's proxy adds to a frozen weight."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(rows, 2) * 0.1)
        self.b = nn.Parameter(torch.randn(2, cols) * 0.1)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.a @ self.b


class Wrapped(nn.Module):
    """Registers ``delta`` on its linear layer's weight for the duration of each forward."""

    def __init__(self, width: int, fail: bool = False, leave: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.delta = Delta(width, width)
        self.fail = fail
        self.leave = leave

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parametrize.register_parametrization(self.linear, "weight", self.delta)
        if self.leave:
            return self.linear(x)
        try:
            with parametrize.cached():
                y = self.linear(x)
                if self.fail:
                    raise ValueError("failed while parametrized")
                return torch.tanh(y) + self.linear(y)  # the cached weight used twice
        finally:
            parametrize.remove_parametrizations(self.linear, "weight", leave_parametrized=False)


def model_of(**options) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Wrapped(4, **options), nn.GELU(), Wrapped(4), nn.Linear(4, 2))


def registrations(module: nn.Module) -> list[tuple[str, str, int]]:
    """Every registered tensor: its name, table and identity."""
    found = []
    for name, sub in module.named_modules():
        found += [(f"{name}.{k}", "parameter", id(v)) for k, v in sub._parameters.items()]
        found += [(f"{name}.{k}", "buffer", id(v)) for k, v in sub._buffers.items()]
    return sorted(found)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("num_slices", [1, 2, 3])
@pytest.mark.parametrize("frozen_base", [False, True])
def test_a_parametrization_registered_in_forward_trains_as_in_the_plain_model(num_slices, checkpoint_activation,
                                                                              frozen_base, device):
    layers = model_of()
    if frozen_base:  # as LoRA trains: the wrapped weights frozen, the deltas trained
        for wrapped in (layers[1], layers[3]):
            wrapped.linear.requires_grad_(False)
    reference = copy.deepcopy(layers).to(device)
    model = OffloadModel(layers, device=device, num_slices=num_slices, checkpoint_activation=checkpoint_activation)
    before = registrations(layers)
    optimizer = torch.optim.SGD([p for p in layers.parameters() if p.requires_grad], lr=0.1, fused=True)
    # On a GPU the reference's optimizer steps host copies, as OffloadModel's does (see HostStepped).
    # (Frozen parameters have no gradient: the optimizer skips them as it skips the frozen ones above.)
    reference_optimizer = HostStepped(reference, lambda params: torch.optim.SGD(params, lr=0.1, fused=True))
    for step in range(3):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step)).to(device)
        got, want = model(x), reference(x)
        torch.testing.assert_close(got, want, **EXACT)
        got.square().sum().backward()
        want.square().sum().backward()
        assert_same_grads(layers, reference, **EXACT)
        assert registrations(layers) == before
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), **EXACT)
    assert registrations(layers) == before


def test_a_failure_while_parametrized_leaves_the_modules_as_they_were():
    layers = model_of(fail=True)
    before = registrations(layers)
    model = OffloadModel(layers, device="cpu", num_slices=2)
    with pytest.raises(ValueError, match="failed while parametrized"):
        model(torch.randn(3, 4))
    assert registrations(layers) == before
    assert not parametrize.is_parametrized(layers[1].linear)
    layers[1].fail = False
    model(torch.randn(3, 4)).sum().backward()  # and the next step runs
    assert registrations(layers) == before


def test_a_parametrization_left_registered_is_refused_and_removed():
    layers = model_of(leave=True)
    before = registrations(layers)
    model = OffloadModel(layers, device="cpu", num_slices=2)
    with pytest.raises(RuntimeError, match=r"Linear\.weight during forward and left it there.*before the model is wrapped"):
        model(torch.randn(3, 4))
    assert registrations(layers) == before
    assert not parametrize.is_parametrized(layers[1].linear)


def test_a_parametrization_registered_before_wrapping_is_offloaded_like_any_layer():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    parametrize.register_parametrization(layers[2], "weight", Delta(4, 4))
    reference = copy.deepcopy(layers)
    model = OffloadModel(layers, device="cpu", num_slices=2)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    reference(x).sum().backward()
    assert_same_grads(layers, reference, **EXACT)


def test_a_layer_sees_its_weights_as_parameters():
    seen = []

    class Checks(nn.Linear):
        def forward(self, x):
            seen.append(isinstance(self.weight, nn.Parameter))
            return super().forward(x)

    model = OffloadModel(nn.Sequential(Checks(3, 3), Checks(3, 3)), device="cpu", num_slices=2)
    model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    with torch.no_grad():
        model(torch.randn(2, 3))
    assert seen and all(seen)


MOE_OPTIONS = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
}


@pytest.mark.parametrize("kind, target_parameters", [
    ("mixtral", None),  # "all-linear" wraps the router's weight in a ParamWrapper
    ("qwen3_moe", ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),  # LoRA on the fused experts
])
@pytest.mark.parametrize("checkpoint_activation", [True, False])
def test_peft_lora_on_fused_experts_and_routers(kind, target_parameters, checkpoint_activation):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from offload.integrations.transformers import causal_lm_sequential

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        kind, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, max_position_embeddings=64, pad_token_id=0, **MOE_OPTIONS[kind])
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", target_parameters=target_parameters)
    peft_model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config), lora)
    assert any(type(m).__name__ == "ParamWrapper" for m in peft_model.modules())
    with torch.no_grad():  # LoRA's B starts at zero; make every adapter matter
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1)
    reference = copy.deepcopy(peft_model)
    base = peft_model.get_base_model()
    before = registrations(base)
    model = OffloadModel(causal_lm_sequential(base), device="cpu", num_slices=3,
                         checkpoint_activation=checkpoint_activation)
    ids = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(1))
    want = reference(input_ids=ids, labels=ids, use_cache=False)
    want.loss.backward()
    logits = model({"input_ids": ids})
    loss = base.loss_function(logits=logits, labels=ids, vocab_size=97)
    loss.backward()
    torch.testing.assert_close(logits, want.logits, **EXACT)
    torch.testing.assert_close(loss, want.loss, **EXACT)
    assert_same_grads(peft_model, reference, **EXACT)
    assert registrations(base) == before
