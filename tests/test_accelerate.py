"""Accelerate with an OffloadModel on the CPU: ``prepare``, ``accumulate``, ``backward``,
``clip_grad_norm_``, ``save_model`` and ``save_state``/``load_state``, with torch's AdamW and with
OffloadOptimizer, each run compared bit for bit with the plain model trained the same way.

``save_model`` and ``save_state`` keep one tensor per storage; every host copy has one of its own
(Note: [A storage per host copy] in ``offload/streams/host_storage.py``), so all of them are saved.
A Hugging Face causal LM goes in as an ``OffloadedCausalLM`` stepped by an OffloadOptimizer, and
resumes from ``save_state`` bit for bit, tied embeddings included. See ``docs/accelerate.md``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

from .helpers import count_parallel_norms
from .test_save_libraries import EXACT, _scramble, assert_same_state, layers, save_peak

accelerate = pytest.importorskip("accelerate", reason='accelerate is not installed: pip install -e ".[accelerate]"')
safetensors_torch = pytest.importorskip("safetensors.torch", reason='safetensors is not installed: pip install -e ".[test]"')

BATCHES = [(torch.randn(6, 8, generator=torch.Generator().manual_seed(k)),
            torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + k))) for k in range(8)]


def accelerator(accumulation: int = 2):
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate keeps its state in process-wide singletons: each run starts from a fresh one.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accumulation)


def prepared(optimizer_kind: str, offload: bool, perturb: bool = False):
    """A fresh Accelerator and the model and optimizer it prepared."""
    model: nn.Module = layers()
    if perturb:  # what a resume must overwrite
        model.apply(_scramble)
    if offload:
        model = OffloadModel(model, device="cpu", num_slices=3)
    if optimizer_kind == "offload_optimizer":
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = accelerator()
    model, optimizer = acc.prepare(model, optimizer)
    return acc, model, optimizer


def train(acc, model: nn.Module, optimizer, batches) -> None:
    for x, y in batches:
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()


OPTIMIZERS = ["torch_adamw", "offload_optimizer"]


@pytest.fixture(scope="module")
def plain_run() -> dict[str, torch.Tensor]:
    """The plain model trained through Accelerate with torch's AdamW, as OffloadModel must be."""
    acc, model, optimizer = prepared("torch_adamw", offload=False)
    train(acc, model, optimizer, BATCHES)
    return {name: value.clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("optimizer_kind", OPTIMIZERS)
def test_accelerate_trains_as_the_plain_model_and_save_model_keeps_every_tensor(optimizer_kind, plain_run, tmp_path):
    acc, model, optimizer = prepared(optimizer_kind, offload=True)
    assert isinstance(model, OffloadModel)
    assert all(p.device.type == "cpu" for p in model.parameters())
    train(acc, model, optimizer, BATCHES)
    assert_same_state(model.state_dict(), plain_run)
    acc.save_model(model, tmp_path)
    assert_same_state(safetensors_torch.load_file(tmp_path / "model.safetensors"), plain_run)


def test_parallel_clipping_of_an_accelerator_trains_as_the_plain_model(plain_run, monkeypatch):
    """``parallel_clipping(accelerator)``: ``accelerator.clip_grad_norm_`` clips with
    ``offload.clip_grad_norm_``, the same weights bit for bit."""
    from offload.integrations.accelerate_clipping import parallel_clipping

    calls = count_parallel_norms(monkeypatch)
    acc, model, optimizer = prepared("offload_optimizer", offload=True)
    assert parallel_clipping(acc) is acc
    wrapped = acc.clip_grad_norm_
    assert parallel_clipping(acc) is acc and acc.clip_grad_norm_ is wrapped  # twice: wrapped once
    train(acc, model, optimizer, BATCHES)
    assert len(calls) == len(BATCHES) // 2
    assert_same_state(model.state_dict(), plain_run)


@pytest.mark.parametrize("optimizer_kind", OPTIMIZERS)
def test_accelerate_save_state_and_load_state_resume_bit_for_bit(optimizer_kind, plain_run, tmp_path):
    acc, model, optimizer = prepared(optimizer_kind, offload=True)
    train(acc, model, optimizer, BATCHES[:4])
    acc.save_state(tmp_path / "state")
    saved_optimizer = optimizer.state_dict()

    acc, model, optimizer = prepared(optimizer_kind, offload=True, perturb=True)
    acc.load_state(tmp_path / "state")
    # Every parameter and buffer came back, and the optimizer's state.
    assert_same_state(safetensors_torch.load_file(tmp_path / "state" / "model.safetensors"), model.state_dict())
    restored = optimizer.state_dict()
    assert restored["param_groups"] == saved_optimizer["param_groups"]
    for index, values in saved_optimizer["state"].items():
        for key, value in values.items():
            torch.testing.assert_close(restored["state"][index][key], value, **EXACT)
    train(acc, model, optimizer, BATCHES[4:])
    assert_same_state(model.state_dict(), plain_run)


def test_save_model_does_not_copy_the_model():
    measured = save_peak("accelerate_save_model")
    assert measured["model_bytes"] > 100e6
    # A copy of the model would add its 100 MB; measured: 0.3 MB.
    assert measured["growth_bytes"] < 0.05 * measured["model_bytes"], measured


def test_mixed_precision_runs_the_forward_under_autocast_as_the_plain_model():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    plain = layers()
    model = acc.prepare(OffloadModel(layers(), device="cpu", num_slices=3))
    x, y = BATCHES[0]
    acc.backward(nn.functional.mse_loss(model(x), y))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(x)
    nn.functional.mse_loss(want.float(), y).backward()
    assert_same_state({n: p.grad for n, p in model.named_parameters()}, {n: p.grad for n, p in plain.named_parameters()})
    assert_same_state(model.state_dict(), plain.state_dict())  # BatchNorm's running statistics too


# -- an OffloadedCausalLM, as docs/accelerate.md shows it ----------------------------------------------


def token_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 64, (2, 9), generator=generator) for _ in range(8)]


def causal_lm_run(tied: bool, seed: int, batches: list[torch.Tensor], save: str | None = None,
                  load: str | None = None, offload: bool = True) -> tuple[dict[str, torch.Tensor], nn.Module]:
    """A Hugging Face Llama wrapped in an OffloadedCausalLM and stepped by an OffloadOptimizer over
    ``batches`` through a fresh Accelerator (or, without ``offload``, the model itself and torch's
    AdamW): the trained state dict (in Hugging Face names, read after the last update) and the
    Hugging Face model."""
    transformers = pytest.importorskip("transformers",
                                       reason='transformers is not installed: pip install -e ".[transformers]"')
    from offload.integrations.causal_lm import OffloadedCausalLM

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=tied)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    acc = accelerator()
    if offload:
        model = OffloadedCausalLM(hf, device=acc.device, num_slices=2)
        optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    else:
        model, optimizer = hf, torch.optim.AdamW(hf.parameters(), lr=1e-2, fused=True)
    model, optimizer = acc.prepare(model, optimizer)
    if load is not None:
        acc.load_state(load)
    for ids in batches:
        with acc.accumulate(model):
            acc.backward(model(input_ids=ids, labels=ids).loss)
            optimizer.step()
            optimizer.zero_grad()
    if save is not None:
        acc.save_state(save)
    return model.state_dict(), hf


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_offloaded_causal_lm_trains_and_resumes_from_save_state_bit_for_bit(tied, tmp_path):
    batches = token_batches()
    uninterrupted, _ = causal_lm_run(tied, 0, batches)
    assert_same_state(uninterrupted, causal_lm_run(tied, 0, batches, offload=False)[0])  # the plain model's
    causal_lm_run(tied, 0, batches[:4], save=str(tmp_path / "state"))
    # Other weights, which the load replaces.
    resumed, hf = causal_lm_run(tied, 1, batches[4:], load=str(tmp_path / "state"))
    assert list(resumed) == list(hf.state_dict())
    assert_same_state(resumed, uninterrupted)
    if tied:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
