"""A parameter tied across slices: the first slice holds it, later slices borrow it.

See Note: [Tied parameters across slices] in ``offload/streams/host_storage.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer
from offload.model import engine_of

from .helpers import DEVICES, HostStepped, assert_same_grads
from .stream_scenarios import Unembed
from .test_mixed_precision import HALF, converted, master_grads_of

EXACT = {"rtol": 0.0, "atol": 0.0}


class Embed(nn.Module):
    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table

    def forward(self, ids):
        return self.table(ids)


def network(dropout: float = 0.1) -> nn.Sequential:
    torch.manual_seed(0)
    table = nn.Embedding(13, 8)
    return nn.Sequential(Embed(table), nn.Linear(8, 8), nn.GELU(), nn.Dropout(dropout), nn.Linear(8, 8),
                         nn.Tanh(), Unembed(table))


def ids(device: str = "cpu") -> torch.Tensor:
    return torch.randint(0, 13, (4, 5), generator=torch.Generator().manual_seed(1)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("checkpoint_activation", [True, False])
@pytest.mark.parametrize("num_slices", [2, 3, 7])
def test_outputs_and_gradients_are_bit_identical(checkpoint_activation, num_slices, device):
    plain = network().to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=num_slices,
                         checkpoint_activation=checkpoint_activation)
    assert len(list(model.parameters())) == len(list(plain.parameters()))
    for seed in range(2):  # a second backward accumulates into the same .grad
        torch.manual_seed(seed)
        want = plain(ids(device))
        want.pow(2).mean().backward()
        torch.manual_seed(seed)
        got = model(ids(device))
        got.pow(2).mean().backward()
        torch.testing.assert_close(got, want, **EXACT)
        assert_same_grads(model, plain, **EXACT)


@pytest.mark.parametrize("optimizer", [
    pytest.param(lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), id="sgd-momentum"),
    pytest.param(lambda params: torch.optim.AdamW(params, lr=0.01, fused=True), id="adamw-fused"),
])
@pytest.mark.parametrize("host_optimizer", [False, True], ids=["plain", "OffloadOptimizer"])
@pytest.mark.parametrize("device", DEVICES)
def test_training_steps_the_tied_parameter_once(optimizer, host_optimizer, device):
    plain = network(dropout=0.0).to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3)
    # On a GPU the reference's optimizer steps host copies, as OffloadModel's does (see HostStepped).
    plain_optimizer = optimizer(plain.parameters()) if device == "cpu" else HostStepped(plain, optimizer)
    if host_optimizer:
        inner = plain_optimizer if device == "cpu" else plain_optimizer.optimizer
        settings = inner.defaults
        kwargs = {k: settings[k] for k in ("lr", "momentum", "fused") if k in settings and settings[k] is not None}
        offloaded = OffloadOptimizer(model, type(inner), **kwargs)
    else:
        offloaded = optimizer(model.parameters())
    for _ in range(3):
        plain(ids(device)).pow(2).mean().backward()
        model(ids(device)).pow(2).mean().backward()
        plain_optimizer.step()
        offloaded.step()
        plain_optimizer.zero_grad()
        offloaded.zero_grad()
    for (name, got), want in zip(model.state_dict().items(), plain.state_dict().values()):
        torch.testing.assert_close(got, want.cpu(), **EXACT, msg=name)


def spacing(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element, the distance between consecutive ``dtype`` numbers at ``values`` (one ulp)."""
    finfo = torch.finfo(dtype)
    # |v| in [2**(e-1), 2**e) has ulp eps * 2**(e-1); below the normal range the subnormals' spacing.
    _, exponent = torch.frexp(values.float().abs().clamp_min(finfo.smallest_normal))
    return torch.ldexp(torch.full(values.shape, finfo.eps / 2, device=values.device), exponent)


def assert_tied_gradient_is_the_float32_sum(got: torch.Tensor, holder_use: torch.Tensor, borrower_use: torch.Tensor,
                                            converted_grad: torch.Tensor, dtype: torch.dtype) -> None:
    """The tied gradient under ``compute_dtype``: the float32 sum of its two uses' half-precision
    gradients, bit for bit; the converted model adds them in half precision, so the two are
    within one half-precision ulp of each other (docs/mixed-precision.md)."""
    assert holder_use.dtype == borrower_use.dtype == converted_grad.dtype == dtype
    torch.testing.assert_close(got, holder_use.float() + borrower_use.float(), **EXACT)
    difference = (got - converted_grad.float()).abs()
    assert bool((difference <= spacing(converted_grad, dtype)).all()), difference.max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_under_a_compute_dtype_the_tied_gradient_is_the_float32_sum(set_to_none, dtype, device):
    """Each slice's gradient leaves in float32 and the two are added there, where the plain model
    converted to ``dtype`` adds them in ``dtype``: every other gradient is bit-identical."""
    plain = network(dropout=0.0)
    reference = converted(plain, dtype).to(device)
    # The same model with the head's table a copy of its own: each use's gradient apart.
    apart = copy.deepcopy(reference)
    apart[6].table = copy.deepcopy(apart[6].table)
    model = OffloadModel(copy.deepcopy(plain), device=device, num_slices=3, compute_dtype=dtype)
    for _ in range(2):  # the second into .grad zeroed, or set to None, by the first
        for m in (reference, apart, model):
            m.zero_grad(set_to_none=set_to_none)
        want = reference(ids(device))
        want.float().pow(2).mean().backward()
        apart(ids(device)).float().pow(2).mean().backward()
        got = model(ids(device))
        got.float().pow(2).mean().backward()
        torch.testing.assert_close(got, want, **EXACT)
        expected = master_grads_of(reference)
        for (name, p), q in zip(model.named_parameters(), expected.parameters()):
            if name != "0.table.weight":
                torch.testing.assert_close(p.grad, q.grad.cpu(), **EXACT, msg=name)
        assert_tied_gradient_is_the_float32_sum(model[0].table.weight.grad, apart[0].table.weight.grad.cpu(),
                                                apart[6].table.weight.grad.cpu(),
                                                reference[0].table.weight.grad.cpu(), dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_a_tied_gpt2_under_a_compute_dtype(dtype):
    """GPT-2 ties ``lm_head`` to ``wte`` (the first slice holds it, the last borrows it): the same
    float32 sum, every other gradient bit-identical to the model converted to ``dtype``."""
    transformers = pytest.importorskip("transformers")
    from offload.integrations.transformers import causal_lm_sequential

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(config)
    assert hf.lm_head.weight is hf.transformer.wte.weight
    reference = converted(hf, dtype)
    apart = copy.deepcopy(reference)
    apart.lm_head.weight = nn.Parameter(apart.transformer.wte.weight.detach().clone())
    model = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=3, compute_dtype=dtype)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    want = reference(input_ids=tokens, use_cache=False).logits
    reference.loss_function(logits=want, labels=tokens, vocab_size=64).backward()
    apart.loss_function(logits=apart(input_ids=tokens, use_cache=False).logits, labels=tokens, vocab_size=64).backward()
    got = model({"input_ids": tokens})
    hf.loss_function(logits=got, labels=tokens, vocab_size=64).backward()
    torch.testing.assert_close(got, want, **EXACT)
    for (name, p), q in zip(hf.named_parameters(), master_grads_of(reference).parameters()):
        if name != "transformer.wte.weight":
            torch.testing.assert_close(p.grad, q.grad, **EXACT, msg=name)
    assert_tied_gradient_is_the_float32_sum(hf.transformer.wte.weight.grad, apart.transformer.wte.weight.grad,
                                            apart.lm_head.weight.grad, reference.transformer.wte.weight.grad, dtype)


def test_the_borrowing_slice_loads_the_holders_current_values():
    model = OffloadModel(network(dropout=0.0), device="cpu", num_slices=3)
    table = model.get_submodule("0").table
    assert model.get_submodule("6").table is table
    before = model(ids())
    with torch.no_grad():
        table.weight.mul_(2)  # in place, as an optimizer writes
    after = model(ids())
    assert not torch.equal(before, after)
    plain = network(dropout=0.0)
    with torch.no_grad():
        plain[0].table.weight.mul_(2)
    torch.testing.assert_close(after, plain(ids()), **EXACT)
    # Replacing .data on the holder re-lays the slices out; the borrower follows.
    table.weight.data = torch.zeros_like(table.weight)
    plain[0].table.weight.data = torch.zeros_like(plain[0].table.weight)
    torch.testing.assert_close(model(ids()), plain(ids()), **EXACT)


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeroed"])
def test_the_tied_gradient_is_summed_in_its_pooled_buffer(set_to_none):
    """Note: [A tied weight's gradients summed in place]: the two slices' gradients are added into
    the holder's pooled buffer, bit for bit autograd's sum, and .grad is that buffer: no tensor
    of the weight's size outside the pool, step after step."""
    plain = network(dropout=0.0)
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=3)
    weight = model.get_submodule("0").table.weight
    pool = engine_of(model).pool
    for seed in range(3):
        for m in (plain, model):
            torch.manual_seed(seed)
            m(ids()).pow(2).mean().backward()
        assert_same_grads(model, plain, **EXACT)
        address = weight.grad.data_ptr()
        assert any(b.data.data_ptr() <= address < b.data.data_ptr() + b.data.numel() for b in pool.buffers())
        for m in (plain, model):
            m.zero_grad(set_to_none=set_to_none)


class Reads(nn.Module):
    """A middle layer that computes with the table's weight once (scores over the vocabulary)."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.table = table
        self.proj = nn.Linear(13, 8)

    def forward(self, x):
        return x + self.proj(torch.tanh(x @ self.table.weight.t()))


@pytest.mark.parametrize("uses", [3, 4])
def test_a_weight_in_three_slices_or_more_sums_as_the_plain_model(uses):
    """The plain model's backward meets the last slice's use first: its sum is ((g_n + ...) + g_2) +
    g_1, which differs in rounding from the slices' order (Note: [A tied weight's gradients summed
    in place])."""
    torch.manual_seed(0)
    table = nn.Embedding(13, 8)
    layers = [Embed(table), nn.Linear(8, 8), nn.Tanh()]
    for _ in range(uses - 2):
        layers += [Reads(table), nn.Linear(8, 8), nn.Tanh()]
    plain = nn.Sequential(*layers, Unembed(table))
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=len(plain))
    for seed in range(2):
        for m in (plain, model):
            torch.manual_seed(seed)
            m(ids()).pow(2).mean().backward()
        assert_same_grads(model, plain, **EXACT)


def test_with_the_masters_on_disk_the_sum_stays_out_of_the_gradient_file(tmp_path):
    """The holder's gradient lands in its file, whose write-back is on its way: the tied sum is
    gathered in the borrowing slice's pooled buffer instead, the same bits as with the masters in
    RAM (Note: [A tied weight's gradients summed in place])."""
    from offload import DiskTier

    grads = []
    for masters in (None, DiskTier(tmp_path)):
        model = OffloadModel(network(dropout=0.0), device="cpu", num_slices=3, compute_dtype=torch.bfloat16,
                             masters=masters)
        model(ids()).float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        weight = model.get_submodule("0").table.weight
        for s in engine_of(model).slices:
            home = s.storage.gradient_home
            if home is not None:
                assert not home.file.address <= weight.grad.data_ptr() < home.file.address + home.file.nbytes
    assert engine_of(model).slices[0].storage.gradient_home is not None
    for ram, disk in zip(*grads):
        torch.testing.assert_close(disk, ram, **EXACT)
