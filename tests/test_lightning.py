"""PyTorch Lightning trains an OffloadModel as it trains the plain model, bit for bit.

Every test builds the same ``LightningModule`` twice, around the plain layers and around an
OffloadModel of the same layers (same seed, same data order), and fits both with what Lightning
does to a model and an optimizer: ``.to()`` of the module, ``optimizer.step(closure)`` with
forward, backward and ``clip_gradients`` inside the closure, gradient accumulation, a learning-rate
scheduler stepped every step, ``optimizer.state`` moved at teardown, ``ModelCheckpoint`` and
``fit(ckpt_path=...)``. The resume test also runs a module holding an ``OffloadedCausalLM`` (the
README's way), whose checkpoint holds the Hugging Face names. On the CPU, ``accelerator="cpu"``;
nothing is downloaded.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import offload.clipping
from offload import OffloadModel, OffloadOptimizer
from offload.optimizing import deferred_scaling

from .helpers import count_parallel_norms

L = pytest.importorskip("lightning", reason='lightning is not installed: pip install -e ".[lightning]"')
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402  (needs lightning)

from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402  (needs lightning)

from offload.integrations.lightning import OffloadStrategy, RandomState  # noqa: E402  (needs lightning)

ROOT = Path(__file__).resolve().parents[1]
EXACT = {"rtol": 0.0, "atol": 0.0}
WARMUP = 3  # optimizer steps of linear learning-rate warm-up


class Task(L.LightningModule):
    """One model, one loss, one optimizer with a warm-up schedule; records what each step saw.

    Args:
        net: the plain layers or an OffloadModel of them, called on a batch's input.
        loss_of: ``(net output, batch) -> loss``.
        optimizer: ``"offload"`` for an OffloadOptimizer, ``"adamw"`` for ``torch.optim.AdamW``
            over the net's parameters (what the reference always uses).
        disk_tier: the OffloadOptimizer's disk tier directory, if any.
    """

    def __init__(self, net: nn.Module, loss_of: Any, optimizer: str = "adamw", disk_tier: Path | None = None) -> None:
        super().__init__()
        self.net, self.loss_of, self.optimizer_kind, self.disk_tier = net, loss_of, optimizer, disk_tier
        self.losses: list[torch.Tensor] = []
        self.grad_norms: list[torch.Tensor] = []  # before clipping, per optimizer step

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        loss = self.loss_of(self.net(batch[0]), batch)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val_loss", self.loss_of(self.net(batch[0]), batch))

    def predict_step(self, batch: Any, index: int) -> torch.Tensor:
        return self.net(batch[0])

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning calls it inside the closure, after backward and before clip_gradients.
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.grad_norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def configure_optimizers(self) -> Any:
        if self.optimizer_kind == "offload":
            optimizer = OffloadOptimizer(self.net, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=self.disk_tier)
        elif self.optimizer_kind == "offload-norms-in-backward":  # the trainer's accumulate_grad_batches=2
            optimizer = OffloadOptimizer(self.net, torch.optim.AdamW, lr=1e-2, fused=True, norms_in_backward=True,
                                         accumulation_steps=2)
        elif self.optimizer_kind == "offload-scale-in-update":  # and the clip's scaling in each slice's update
            optimizer = OffloadOptimizer(self.net, torch.optim.AdamW, lr=1e-2, fused=True, norms_in_backward=True,
                                         scale_in_update=True, accumulation_steps=2)
        elif self.optimizer_kind == "offload-in-backward":  # the trainer's accumulate_grad_batches=2
            optimizer = OffloadOptimizer(self.net, torch.optim.AdamW, lr=1e-2, fused=True, update_in_backward=True,
                                         accumulation_steps=2)
        else:
            optimizer = torch.optim.AdamW(self.net.parameters(), lr=1e-2, fused=True)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def trainer(root: Path, epochs: int, **options: Any) -> L.Trainer:
    options = {"enable_checkpointing": False, "precision": "32-true", "gradient_clip_val": 1.0, **options}
    return L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, accumulate_grad_batches=2, default_root_dir=root, **options)


def loader(*tensors: torch.Tensor, batch_size: int = 4) -> DataLoader:
    """Shuffled the same way in every run, and again after a resume: the sampler's order is a
    function of its seed and the epoch, which Lightning sets (``set_epoch``) before each epoch."""
    data = TensorDataset(*tensors)
    return DataLoader(data, batch_size=batch_size,
                      sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=3))


def fit(task: Task, root: Path, epochs: int, data: DataLoader, **options: Any) -> L.Trainer:
    torch.manual_seed(5)  # dropout draws from here: the same in every run
    run = trainer(root, epochs, **options)
    run.fit(task, data)
    return run


# -- the models --------------------------------------------------------------------------------------


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def mlp_data() -> DataLoader:
    generator = torch.Generator().manual_seed(2)
    # Targets far from the initial outputs: the gradients' norm starts above the clipping threshold.
    return loader(torch.randn(32, 8, generator=generator), 4 * torch.randn(32, 4, generator=generator))


def mse(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.mse_loss(output, batch[1])


class LogitsOf(nn.Module):
    """The Hugging Face model as the reference calls it: its own forward, in the training setting."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.hf(**batch, use_cache=False).logits


def llama() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason='transformers is not installed: pip install -e ".[transformers]"')
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, attention_dropout=0.1, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config)


def token_data() -> DataLoader:
    ids = torch.randint(1, 97, (16, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0  # some rows left-padded
    return loader(ids, mask)


def causal_lm_loss(hf: nn.Module, logits: torch.Tensor, batch: Any) -> torch.Tensor:
    labels = batch[0].masked_fill(batch[1] == 0, -100)
    return hf.loss_function(logits=logits, labels=labels, vocab_size=hf.config.vocab_size)


class TokenTask(Task):
    def __init__(self, net: nn.Module, hf: nn.Module, optimizer: str = "adamw") -> None:
        super().__init__(net, None, optimizer)
        self.__dict__["hf"] = hf  # for its loss function only: the net holds its modules
        self.loss_of = functools.partial(causal_lm_loss, hf)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        loss = self.loss_of(self.net({"input_ids": batch[0], "attention_mask": batch[1]}), batch)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val_loss", self.loss_of(self.net({"input_ids": batch[0], "attention_mask": batch[1]}), batch))

    def predict_step(self, batch: Any, index: int) -> torch.Tensor:
        return self.net({"input_ids": batch[0], "attention_mask": batch[1]})


class CausalLMTask(Task):
    """The README's way: the module holds an ``OffloadedCausalLM``, whose forward computes the model's loss."""

    def step_loss(self, batch: Any) -> torch.Tensor:
        labels = batch[0].masked_fill(batch[1] == 0, -100)
        return self.net(input_ids=batch[0], attention_mask=batch[1], labels=labels).loss

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        loss = self.step_loss(batch)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val_loss", self.step_loss(batch))

    def predict_step(self, batch: Any, index: int) -> torch.Tensor:
        return self.net(input_ids=batch[0], attention_mask=batch[1]).logits


def built(model: str, offloaded: bool, optimizer: str = "adamw") -> tuple[Task, nn.Module, DataLoader]:
    """The task, the module whose ``state_dict()`` holds the trained weights, and the data."""
    if model == "causal-lm" and offloaded:  # an OffloadedCausalLM; the plain run is "llama"'s
        from offload.integrations.causal_lm import OffloadedCausalLM

        hf = llama()
        return CausalLMTask(OffloadedCausalLM(hf, device="cpu", num_slices=3), None, optimizer), hf, token_data()
    if model == "mlp":
        layers = mlp()
        net = OffloadModel(layers, device="cpu", num_slices=3) if offloaded else layers
        return Task(net, mse, optimizer), layers, mlp_data()
    from offload.integrations.transformers import causal_lm_sequential

    hf = llama()
    net = OffloadModel(causal_lm_sequential(hf), device="cpu", num_slices=3) if offloaded else LogitsOf(hf)
    return TokenTask(net, hf, optimizer), hf, token_data()


def assert_same_run(actual: Task, expected: Task, actual_weights: nn.Module, expected_weights: nn.Module) -> None:
    assert len(actual.losses) == len(expected.losses) > 0
    for step, (a, e) in enumerate(zip(actual.losses, expected.losses)):
        torch.testing.assert_close(a, e, **EXACT, msg=lambda m: f"loss at batch {step}: {m}")
    got, want = actual_weights.state_dict(), expected_weights.state_dict()
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **EXACT, msg=lambda m: f"{name}: {m}")


# -- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["mlp", "llama", "causal-lm"])
@pytest.mark.parametrize("optimizer", ["offload", "adamw"])
def test_fit_validate_predict_equal_the_plain_model(tmp_path: Path, model: str, optimizer: str) -> None:
    expected, expected_weights, data = built(model, offloaded=False)
    reference = fit(expected, tmp_path / "plain", 2, data)
    actual, actual_weights, data = built(model, offloaded=True, optimizer=optimizer)
    run = fit(actual, tmp_path / "offloaded", 2, data)

    assert run.global_step == reference.global_step == len(expected.losses) // 2  # accumulated over 2 batches
    assert max(expected.grad_norms) > 1.0  # clip_gradients clipped some steps
    assert_same_run(actual, expected, actual_weights, expected_weights)
    assert run.optimizers[0].param_groups[0]["lr"] == reference.optimizers[0].param_groups[0]["lr"] == 1e-2

    assert run.validate(actual, data, verbose=False) == reference.validate(expected, data, verbose=False)
    for got, want in zip(run.predict(actual, data), reference.predict(expected, data), strict=True):
        torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("optimizer", ["offload", "offload-norms-in-backward", "offload-scale-in-update"])
def test_the_strategy_clips_through_offloads_clip_grad_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             optimizer: str) -> None:
    """Under OffloadStrategy, ``gradient_clip_val`` computes the norms with ``offload.clip_grad_norm_``
    (the host gradients' norms on several threads, or computed in backward; the scaling at the clip
    or in each slice's update), and the run is still the plain model's."""
    calls = count_parallel_norms(monkeypatch)
    scaled_at_clip: list[int] = []
    real_scaling = offload.clipping.clip_grads_with_norm_
    monkeypatch.setattr(offload.clipping, "clip_grads_with_norm_",
                        lambda ps, *a: scaled_at_clip.append(len(ps)) or real_scaling(ps, *a))
    computed: list[int] = []  # the norms each clip computed itself
    real = offload.clipping.pooled_norms
    monkeypatch.setattr(offload.clipping, "pooled_norms", lambda ts, *a: computed.append(len(ts)) or real(ts, *a))
    alone: list[int] = []  # the slices whose scaling ran by itself, not in their update
    real_alone = deferred_scaling._scale
    monkeypatch.setattr(deferred_scaling, "_scale", lambda owed, index: alone.append(index) or real_alone(owed, index))
    expected, expected_weights, data = built("mlp", offloaded=False)
    reference = fit(expected, tmp_path / "plain", 2, data)
    actual, actual_weights, data = built("mlp", offloaded=True, optimizer=optimizer)
    run = fit(actual, tmp_path / "offloaded", 2, data, strategy=OffloadStrategy("cpu"))
    assert len(calls) == run.global_step == reference.global_step
    # With the norms computed in backward, the first clip computes them all again to compare, the others none.
    parameters = len(list(actual.parameters()))
    assert computed == [parameters] + [0 if optimizer != "offload" else parameters] * (len(computed) - 1)
    assert max(expected.grad_norms) > 1.0  # clip_gradients clipped some steps
    assert (scaled_at_clip == []) == (optimizer == "offload-scale-in-update") and calls and alone == []
    assert_same_run(actual, expected, actual_weights, expected_weights)


@pytest.mark.parametrize("model", ["mlp", "llama"])
def test_update_in_backward_under_lightning_equals_the_plain_model(tmp_path: Path, model: str) -> None:
    """Lightning runs backward inside optimizer.step(closure); without clipping the update starts
    in the backward of each accumulation's last batch."""
    expected, expected_weights, data = built(model, offloaded=False)
    reference = fit(expected, tmp_path / "plain", 2, data, gradient_clip_val=None)
    actual, actual_weights, data = built(model, offloaded=True, optimizer="offload-in-backward")
    run = fit(actual, tmp_path / "offloaded", 2, data, gradient_clip_val=None)
    assert run.global_step == reference.global_step
    assert_same_run(actual, expected, actual_weights, expected_weights)
    in_backward = run.optimizers[0]._in_backward
    assert in_backward.checked and in_backward.last_started


def test_bf16_mixed_autocasts_around_the_offloaded_model_as_around_the_plain_one(tmp_path: Path) -> None:
    # Without clipping: Lightning's mixed-precision plugins refuse gradient_clip_val with a fused
    # optimizer (it unscales inside step()), plain or offloaded alike.
    expected, expected_weights, data = built("mlp", offloaded=False)
    fit(expected, tmp_path / "plain", 1, data, precision="bf16-mixed", gradient_clip_val=None)
    actual, actual_weights, data = built("mlp", offloaded=True, optimizer="offload")
    fit(actual, tmp_path / "offloaded", 1, data, precision="bf16-mixed", gradient_clip_val=None)
    assert_same_run(actual, expected, actual_weights, expected_weights)


@pytest.mark.parametrize("model", ["mlp", "causal-lm"])
def test_resume_from_a_model_checkpoint_equals_the_uninterrupted_run(tmp_path: Path, model: str) -> None:
    # Dropout draws from the global generator, which Lightning does not save: RandomState does.
    uninterrupted, uninterrupted_weights, data = built(model, offloaded=True, optimizer="offload")
    fit(uninterrupted, tmp_path / "uninterrupted", 3, data, callbacks=[RandomState()])

    first, _, data = built(model, offloaded=True, optimizer="offload")
    saving = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_top_k=-1, every_n_epochs=1)
    first_run = fit(first, tmp_path / "first", 1, data, enable_checkpointing=True, callbacks=[saving, RandomState()])
    steps = first_run.global_step
    checkpoint = tmp_path / "checkpoints" / f"epoch=0-step={steps}.ckpt"
    assert checkpoint.exists()

    resumed, resumed_weights, data = built(model, offloaded=True, optimizer="offload")
    torch.manual_seed(123)  # whatever the generator held: the checkpoint's state replaces it
    run = trainer(tmp_path / "resumed", 3, callbacks=[RandomState()])
    run.fit(resumed, data, ckpt_path=checkpoint)

    assert run.global_step == 3 * steps
    resumed.losses = first.losses + resumed.losses
    assert_same_run(resumed, uninterrupted, resumed_weights, uninterrupted_weights)


def test_the_docs_example_resumes_in_a_new_process_bit_for_bit(tmp_path: Path) -> None:
    """docs/lightning.md's example, run as its reader runs it: once through, and again in a new
    process with the ``ckpt_path`` its last comment gives, from the first run's checkpoint. The
    resumed run ends with the uninterrupted run's weights and optimizer state, bit for bit."""
    pytest.importorskip("transformers", reason='transformers is not installed: pip install -e ".[transformers]"')
    example = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "lightning.md").read_text(), re.S)
    assert example is not None
    code = example.group(1)
    resume = re.search(r"^# (trainer\.fit\((.+?), loader, loader, ckpt_path=\"(.+?)\"\))$", code, re.M)
    assert resume is not None, "the example ends with the resume line, commented out"
    fit_line = f"trainer.fit({resume.group(2)}, loader, loader)\n"
    assert code.count(fit_line) == 1

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for run, script in (("uninterrupted", code), ("resumed", code.replace(fit_line, resume.group(1) + "\n"))):
        (tmp_path / run).mkdir()
        if run == "resumed":  # the first run's checkpoint, where the second process looks for it
            (tmp_path / run / resume.group(3)).parent.mkdir(parents=True)
            (tmp_path / run / resume.group(3)).write_bytes((tmp_path / "uninterrupted" / resume.group(3)).read_bytes())
        (tmp_path / run / "example.py").write_text(script)
        done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path / run, capture_output=True, text=True,
                              timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]

    last = sorted((tmp_path / "uninterrupted").glob(f"{Path(resume.group(3)).parent}/*.ckpt"),
                  key=lambda path: int(re.search(r"step=(\d+)", path.name).group(1)))[-1]
    assert last.name != Path(resume.group(3)).name
    want = torch.load(last, weights_only=False)
    got = torch.load(tmp_path / "resumed" / last.relative_to(tmp_path / "uninterrupted"), weights_only=False)
    assert list(got["state_dict"]) == list(want["state_dict"])
    for name, value in want["state_dict"].items():
        torch.testing.assert_close(got["state_dict"][name], value, **EXACT, msg=lambda m: f"{name}: {m}")
    for index, state in want["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["optimizer_states"][0]["state"][index][key], value, **EXACT)


def test_a_disk_tier_is_checkpointed_beside_the_file_slice_by_slice(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def gathered(self: OffloadOptimizer) -> Any:
        raise AssertionError("state_dict() gathers the disk tier's whole state in host memory")

    monkeypatch.setattr(OffloadOptimizer, "state_dict", gathered)

    def on_disk(name: str) -> tuple[Task, nn.Module, DataLoader]:
        layers = mlp()
        task = Task(OffloadModel(layers, device="cpu", num_slices=3), mse, "offload", disk_tier=tmp_path / name)
        return task, layers, mlp_data()

    uninterrupted, uninterrupted_weights, data = on_disk("tier-uninterrupted")
    fit(uninterrupted, tmp_path / "uninterrupted", 2, data, strategy=OffloadStrategy("cpu"))

    first, _, data = on_disk("tier-first")
    every = ModelCheckpoint(dirpath=tmp_path / "every", save_top_k=-1, every_n_epochs=1)
    newest = ModelCheckpoint(dirpath=tmp_path / "newest", save_top_k=1, monitor="epoch", mode="max")
    fit(first, tmp_path / "first", 2, data, enable_checkpointing=True, callbacks=[every, newest],
        strategy=OffloadStrategy("cpu"))
    checkpoint = tmp_path / "every" / "epoch=0-step=4.ckpt"
    saved = torch.load(checkpoint, weights_only=False)
    (marker,) = saved["optimizer_states"]
    assert list(marker) == [OffloadStrategy.marker]  # naming the save's directory (Note: [The file commits the pair])
    assert (tmp_path / "every" / "epoch=0-step=4.ckpt.offload" / marker[OffloadStrategy.marker] / "offload.json").exists()
    # ModelCheckpoint removes the directory with the file it replaces.
    assert sorted(p.name for p in (tmp_path / "newest").glob("epoch*")) == ["epoch=1-step=8.ckpt",
                                                                            "epoch=1-step=8.ckpt.offload"]

    alone = tmp_path / "alone.ckpt"
    alone.write_bytes(checkpoint.read_bytes())  # without its directory
    with pytest.raises(ValueError, match=r"no directory .*alone\.ckpt\.offload; copy or move the file together"):
        trainer(tmp_path / "alone", 2, strategy=OffloadStrategy("cpu")).fit(on_disk("tier-alone")[0], data,
                                                                             ckpt_path=alone)

    # Dropout draws what the uninterrupted run drew: load_checkpoint restores the generators.
    resumed, resumed_weights, data = on_disk("tier-resumed")
    torch.manual_seed(123)
    run = trainer(tmp_path / "resumed", 2, strategy=OffloadStrategy("cpu"))
    run.fit(resumed, data, ckpt_path=checkpoint)
    assert len(resumed.losses) == len(first.losses) // 2
    resumed.losses = first.losses[:len(resumed.losses)] + resumed.losses
    assert_same_run(resumed, uninterrupted, resumed_weights, uninterrupted_weights)


def test_a_weights_only_checkpoint_streams_nothing_of_a_disk_tier(tmp_path: Path) -> None:
    def task() -> Task:
        return Task(OffloadModel(mlp(), device="cpu", num_slices=3), mse, "offload", disk_tier=tmp_path / "tier")

    trained = task()
    weights = ModelCheckpoint(dirpath=tmp_path / "weights", save_weights_only=True, every_n_epochs=1)
    run = fit(trained, tmp_path / "run", 1, mlp_data(), enable_checkpointing=True, callbacks=[weights],
              strategy=OffloadStrategy("cpu"))
    manual = tmp_path / "manual.ckpt"
    run.save_checkpoint(manual)  # a whole checkpoint first: its state streamed beside it
    assert (tmp_path / "manual.ckpt.offload").is_dir()
    run.save_checkpoint(manual, weights_only=True)  # then the weights only, under the same name
    files = [*(tmp_path / "weights").glob("*.ckpt"), manual]
    assert len(files) == 2
    want = trained.state_dict()
    for file in files:
        saved = torch.load(file, weights_only=False)
        assert "optimizer_states" not in saved
        assert not Path(f"{file}.offload").exists(), f"{file}: the optimizer's state was streamed beside it"
        assert list(saved["state_dict"]) == list(want)
        for name, value in want.items():
            torch.testing.assert_close(saved["state_dict"][name], value, **EXACT, msg=lambda m: f"{name}: {m}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("manual")) == ["manual.ckpt"]
    # It loads as Lightning loads any weights-only checkpoint: the weights, not a resume.
    with pytest.raises(KeyError, match="save_weights_only"):
        trainer(tmp_path / "resumed", 2, strategy=OffloadStrategy("cpu")).fit(task(), mlp_data(), ckpt_path=manual)
    loaded = task()
    loaded.load_state_dict(torch.load(manual, weights_only=False)["state_dict"])
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, want[name], **EXACT, msg=lambda m: f"{name}: {m}")


def test_a_loaded_optimizer_state_stays_beside_its_parameters() -> None:
    # Lightning moves a loaded state to the accelerator: "meta" stands for one here.
    model = OffloadModel(mlp(), device="cpu", num_slices=3)
    optimizer = OffloadOptimizer(model, torch.optim.AdamW, lr=1e-2, fused=True)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    for strategy, device in ((SingleDeviceStrategy(torch.device("meta")), "meta"),
                             (OffloadStrategy(torch.device("meta")), "cpu")):
        strategy.optimizers = [optimizer]
        strategy.load_optimizer_state_dict({"optimizer_states": [saved]})
        assert {t.device.type for s in optimizer.state.values() for k, t in s.items() if k != "step"} == {device}


class SlowAdamW(torch.optim.AdamW):
    """AdamW that takes a while before it starts: its state is still being made after step() returned."""

    def step(self, closure: Any = None) -> Any:
        time.sleep(0.2)
        return super().step(closure)


def test_teardown_moves_the_state_of_finished_updates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning's teardown walks optimizer.state and moves each tensor to the CPU right after the
    # last step(); OffloadOptimizer's state waits for the update that makes it.
    import lightning.pytorch.strategies.strategy as strategy

    seen: list[int] = []
    move = strategy._optimizers_to_device

    def recording(optimizers: Any, device: Any) -> None:
        seen.append(sum(len(optimizer.state) for optimizer in optimizers))
        move(optimizers, device)

    monkeypatch.setattr(strategy, "_optimizers_to_device", recording)
    task = Task(OffloadModel(mlp(), device="cpu", num_slices=3), mse)
    task.configure_optimizers = lambda: OffloadOptimizer(task.net, SlowAdamW, lr=1e-2, fused=True)  # type: ignore[method-assign]
    fit(task, tmp_path, 1, mlp_data(), max_steps=1)
    assert seen[-1] == len(list(task.net.parameters()))  # every parameter's state, at teardown
