"""Accelerate and Lightning moving an ``OffloadedCausalLM`` to the GPU with ``.to("cuda")``, as
they move any model, against the plain Hugging Face model trained the same way on the GPU.

Built on the host (``device="cpu"``), the offloaded model is moved by the framework: Accelerate's
``prepare`` and Lightning's strategy call ``model.to(cuda)``. That must move the compute (slots,
resident slices, the walk) and leave every parameter's host copy where it is, pinned. The
trainings clip the gradients (the update behind the next forward). Float32 on the GPU: the same
losses and weights as the plain model's to float32 rounding of a differently ordered sum. The
Trainer's test of the same is in ``tests/test_trainer.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload import OffloadOptimizer
from offload.integrations.causal_lm import OffloadedCausalLM

from .helpers import CUDA

transformers = pytest.importorskip("transformers", reason='transformers is not installed: pip install -e ".[transformers]"')

CLOSE = {"rtol": 1e-4, "atol": 1e-5}
VOCAB = 97


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config)


def batches(count: int = 6) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(1, VOCAB, (4, 10), generator=g)
        mask = torch.ones_like(ids)
        mask[::3, :2] = 0  # some rows left-padded
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def models(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model to train and the Hugging Face model whose weights it trains."""
    hf = llama()
    return (hf, hf) if kind == "plain" else (OffloadedCausalLM(hf, device="cpu", num_slices=2), hf)


def optimizer_of(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "plain":
        return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return OffloadOptimizer(model.offloaded, torch.optim.AdamW, lr=1e-2, fused=True)


def assert_on_the_gpu_with_host_parameters(model: OffloadedCausalLM, hf: torch.nn.Module) -> None:
    assert model.device.type == "cuda"
    assert all(p.device.type == "cpu" and p.is_pinned() for p in hf.parameters())


def assert_same_training(losses: dict[str, list[float]], weights: dict[str, dict[str, torch.Tensor]]) -> None:
    assert len(losses["offloaded"]) == len(losses["plain"]) > 0
    torch.testing.assert_close(losses["offloaded"], losses["plain"], rtol=1e-4, atol=0)
    assert list(weights["offloaded"]) == list(weights["plain"])
    for name, value in weights["plain"].items():
        torch.testing.assert_close(weights["offloaded"][name], value, **CLOSE, msg=lambda m: f"{name}: {m}")
    # Trained: the weights moved from where they started.
    start = dict(llama().named_parameters())
    assert any(not torch.equal(start[n].detach(), v) for n, v in weights["plain"].items())


@CUDA
def test_accelerate_prepare_moves_an_offloaded_causal_lm_to_the_gpu_and_trains_as_the_plain_model():
    accelerate = pytest.importorskip("accelerate", reason='accelerate is not installed: pip install -e ".[accelerate]"')
    from accelerate.state import AcceleratorState, GradientState

    losses, weights = {}, {}
    for kind in ("plain", "offloaded"):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        acc = accelerate.Accelerator()
        model, hf = models(kind)
        model, optimizer = acc.prepare(model, optimizer_of(kind, model))
        if kind == "offloaded":
            assert_on_the_gpu_with_host_parameters(model, hf)
        losses[kind] = []
        for batch in batches():
            loss = model(**{k: v.to(acc.device) for k, v in batch.items()}).loss
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            losses[kind].append(loss.item())
        if kind == "offloaded":
            optimizer.optimizer.synchronize()  # the last update runs behind the next forward: wait for it
        weights[kind] = {n: p.detach().cpu().clone() for n, p in hf.named_parameters()}
    assert_same_training(losses, weights)


@CUDA
def test_lightning_moves_an_offloaded_causal_lm_to_the_gpu_and_trains_as_the_plain_model(tmp_path: Path):
    L = pytest.importorskip("lightning", reason='lightning is not installed: pip install -e ".[lightning]"')

    class Task(L.LightningModule):
        def __init__(self, kind: str) -> None:
            super().__init__()
            self.kind = kind
            self.model, hf = models(kind)
            self.__dict__["hf"] = hf  # the weights' owner, not a second submodule
            self.losses: list[float] = []
            self.devices_seen: list[str] = []

        def training_step(self, batch, index):
            self.devices_seen.append(self.model.device.type)
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return optimizer_of(self.kind, self.model)

    data = batches()
    losses, weights = {}, {}
    for kind in ("plain", "offloaded"):
        task = Task(kind)
        trainer = L.Trainer(accelerator="gpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, gradient_clip_val=0.5,
                            precision="32-true", default_root_dir=tmp_path / kind)
        trainer.fit(task, torch.utils.data.DataLoader(data, batch_size=None))
        assert set(task.devices_seen) == {"cuda"}
        if kind == "offloaded":
            trainer.optimizers[0].synchronize()
            assert all(p.device.type == "cpu" for p in task.hf.parameters())
        losses[kind] = task.losses
        weights[kind] = {n: p.detach().cpu().clone() for n, p in task.hf.named_parameters()}
    assert_same_training(losses, weights)
