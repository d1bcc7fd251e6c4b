"""OffloadStrategy's checkpoint with a disk tier is a pair, Lightning's file and the directory the
optimizers' states stream into beside it; it resumes as one (Note: [The file commits the pair] in
``offload/integrations/lightning.py``).

Each resume is compared, bit for bit, with the run it continues: the uninterrupted run, or for two
optimizers in one module the plain model through the same save and resume. The pairs tested: two
disk tiers in one module (each its own directory), a save that fails or whose process dies
between its directory and its file (``ModelCheckpoint(save_last=True)`` rewrites ``last.ckpt``
under one name), a link to the file (``save_last="link"``), a file beside another save's
directory (refused), and a file an earlier version saved (its marker ``True``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from offload import OffloadModel, OffloadOptimizer
from offload.checkpoint import CheckpointError

L = pytest.importorskip("lightning", reason='lightning is not installed: pip install -e ".[lightning]"')
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402  (needs lightning)
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402  (needs lightning)

import offload.integrations.lightning as lightning_integration  # noqa: E402  (needs lightning)
from offload.integrations.lightning import OffloadStrategy  # noqa: E402  (needs lightning)

ROOT = Path(__file__).resolve().parents[1]
EXACT = {"rtol": 0.0, "atol": 0.0}
EPOCHS = 3  # the uninterrupted run's; every resume ends there


class Task(L.LightningModule):
    """An OffloadModel and an OffloadOptimizer over it with a disk tier in ``tier``."""

    def __init__(self, tier: Path) -> None:
        super().__init__()
        self.net, self.tier = OffloadModel(mlp(0), device="cpu", num_slices=3), tier

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return OffloadOptimizer(self.net, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=self.tier)


class TwoModels(L.LightningModule):
    """Two models of the same shapes with an optimizer each (a generator and its critic), stepped
    by hand: offloaded, each with a disk tier of its own under ``tiers``, or plain (``None``)."""

    def __init__(self, tiers: Path | None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.tiers = tiers
        self.a, self.b = mlp(0), mlp(1)
        if tiers is not None:
            tiers.mkdir(exist_ok=True)  # a disk tier makes its own directory only
            self.a = OffloadModel(self.a, device="cpu", num_slices=3)
            self.b = OffloadModel(self.b, device="cpu", num_slices=3)

    def training_step(self, batch: Any, index: int) -> None:
        optimizer_a, optimizer_b = self.optimizers()
        self.manual_backward((self.b(self.a(batch[0]).detach()) - 1).pow(2).mean())
        optimizer_b.step()
        optimizer_b.zero_grad()
        self.manual_backward((self.b(self.a(batch[0])) + 1).pow(2).mean())
        optimizer_a.step()
        optimizer_a.zero_grad()

    def configure_optimizers(self) -> Any:
        if self.tiers is None:
            return [torch.optim.AdamW(self.a.parameters(), lr=1e-2, fused=True),
                    torch.optim.AdamW(self.b.parameters(), lr=5e-3, fused=True)]
        return [OffloadOptimizer(self.a, torch.optim.AdamW, lr=1e-2, fused=True, disk_tier=self.tiers / "a"),
                OffloadOptimizer(self.b, torch.optim.AdamW, lr=5e-3, fused=True, disk_tier=self.tiers / "b")]


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8))


def data() -> DataLoader:
    generator = torch.Generator().manual_seed(2)
    inputs, targets = torch.randn(16, 8, generator=generator), 4 * torch.randn(16, 8, generator=generator)
    return DataLoader(TensorDataset(inputs, targets), batch_size=4)


def fit(task: L.LightningModule, root: Path, epochs: int, *callbacks: Any, strategy: Any = None,
        ckpt_path: Any = None) -> L.Trainer:
    run = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=root, enable_checkpointing=bool(callbacks),
                    callbacks=list(callbacks), strategy=strategy or OffloadStrategy("cpu"))
    run.fit(task, data(), ckpt_path=ckpt_path)
    return run


def every_epoch(directory: Path, **options: Any) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1, **options)


def assert_same_weights(actual: nn.Module, expected: nn.Module) -> None:
    want = expected.state_dict()
    got = actual.state_dict()
    assert list(got) == list(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Task:
    root = tmp_path_factory.mktemp("uninterrupted")
    task = Task(root / "tier")
    fit(task, root, EPOCHS)
    return task


def test_two_disk_tiers_resume_each_from_its_own_directory(tmp_path: Path) -> None:
    """Each streamed optimizer has a directory of its own: model b's state and weights do not land
    in model a, whose shapes are the same. The resume equals the plain models' through the same
    save and resume (Lightning resumes two hand-stepped optimizers its own way, the same for both)."""
    runs = {}
    for kind, tiers in (("plain", None), ("offloaded", tmp_path / "tiers")):
        fit(TwoModels(tiers), tmp_path / kind, 1, every_epoch(tmp_path / kind / "saved"),
            strategy="auto" if tiers is None else None)
        (saved,) = (tmp_path / kind / "saved").glob("*.ckpt")
        runs[kind] = TwoModels(tiers if tiers is None else tmp_path / "tiers-resumed")
        fit(runs[kind], tmp_path / kind, 2, strategy="auto" if tiers is None else None, ckpt_path=saved)
    assert_same_weights(runs["offloaded"].a, runs["plain"].a)
    assert_same_weights(runs["offloaded"].b, runs["plain"].b)
    markers = torch.load(saved, weights_only=False)["optimizer_states"]
    names = [marker[OffloadStrategy.marker] for marker in markers]
    assert len(set(names)) == 2 and all((Path(f"{saved}.offload") / name / "offload.json").exists() for name in names)


def _last_saves(calls: list[Path], path: Any) -> int:
    """Record ``path`` among ``calls`` if it streams ``last.ckpt``'s state; how many did."""
    if "last.ckpt.offload" in Path(path).parts:
        calls.append(Path(path))
    return len(calls)


def die_saving(root: str, when: str) -> None:
    """A run saving ``last.ckpt`` every epoch whose process dies (``os._exit``, no clean-up) as the
    second epoch's ``last.ckpt`` streams its state: ``"before"`` it starts or ``"after"`` it
    committed. Run in a subprocess by the test below."""
    real, calls = lightning_integration.save_checkpoint, []

    def dying(path: Any, *args: Any, **kwargs: Any) -> Any:
        if _last_saves(calls, path) == 2 and when == "before":
            os._exit(9)
        saved = real(path, *args, **kwargs)
        if len(calls) == 2 and when == "after":
            os._exit(9)
        return saved

    lightning_integration.save_checkpoint = dying
    fit(Task(Path(root) / "tier"), Path(root), EPOCHS, every_epoch(Path(root) / "saved", save_last=True))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_process_killed_between_the_directory_and_the_file_resumes_the_previous_pair(
        tmp_path: Path, uninterrupted: Task, when: str) -> None:
    """Killed while ``last.ckpt``'s state streams, the run leaves the previous ``last.ckpt`` and
    the directory it names: ``ckpt_path="last"`` resumes from the end of the first epoch and
    ends with the uninterrupted run's weights (the file written first, the kill "before" left a
    second epoch's file beside the first epoch's state, and the resume mixed them)."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.test_lightning_checkpoint_pairs import "
            f"die_saving; die_saving({str(tmp_path)!r}, {when!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr[-3000:]
    left = torch.load(tmp_path / "saved" / "last.ckpt", weights_only=False)

    resumed = Task(tmp_path / "tier-resumed")
    fit(resumed, tmp_path / "resumed", EPOCHS, every_epoch(tmp_path / "saved", save_last=True), ckpt_path="last")
    assert_same_weights(resumed, uninterrupted)
    assert left["epoch"] == 0  # the file is written last: the killed save left the previous one
    # The next save of last.ckpt removed what the killed one left.
    (named,) = torch.load(tmp_path / "saved" / "last.ckpt", weights_only=False)["optimizer_states"]
    assert [p.name for p in (tmp_path / "saved" / "last.ckpt.offload").iterdir()] == [
        named[OffloadStrategy.marker].split("/")[0]]


@pytest.mark.parametrize("failing", ["stream", "file"])
def test_a_save_that_fails_leaves_the_previous_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    uninterrupted: Task, failing: str) -> None:
    """The second epoch's ``last.ckpt`` fails, in its state's stream (a full disk) or in
    Lightning's write of the file: the error reaches ``fit``, ``last.ckpt`` and its directory are
    the first epoch's, with nothing of the failed save beside them, and resume exactly."""
    calls: list[Path] = []
    real_stream, real_write = lightning_integration.save_checkpoint, TorchCheckpointIO.save_checkpoint

    def stream(path: Any, *args: Any, **kwargs: Any) -> Any:
        if _last_saves(calls, path) == 2 and failing == "stream":
            raise CheckpointError("the save failed: no space left on device")
        return real_stream(path, *args, **kwargs)

    def write(self: TorchCheckpointIO, checkpoint: dict[str, Any], path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).name == "last.ckpt" and len(calls) == 2 and failing == "file":
            raise OSError(28, "No space left on device")
        real_write(self, checkpoint, path, *args, **kwargs)

    monkeypatch.setattr(lightning_integration, "save_checkpoint", stream)
    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", write)
    with pytest.raises(CheckpointError if failing == "stream" else OSError, match="space"):
        fit(Task(tmp_path / "tier"), tmp_path / "failed", EPOCHS, every_epoch(tmp_path / "saved", save_last=True))
    monkeypatch.undo()

    last = tmp_path / "saved" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    beside = sorted(p.name for p in Path(f"{last}.offload").iterdir())
    resumed = Task(tmp_path / "tier-resumed")
    fit(resumed, tmp_path / "resumed", EPOCHS, ckpt_path=last)
    assert_same_weights(resumed, uninterrupted)
    assert saved["epoch"] == 0
    assert beside == [saved["optimizer_states"][0][OffloadStrategy.marker].split("/")[0]]


def test_a_link_to_the_file_resumes_from_the_directory_beside_its_target(tmp_path: Path, uninterrupted: Task) -> None:
    """``ModelCheckpoint(save_last="link")`` links ``last.ckpt`` to the epoch's file, whose
    directory is beside the target only: ``ckpt_path="last"`` resumes from it exactly. A file
    beside another save's directory is refused, naming both, instead of mixing them."""
    fit(Task(tmp_path / "tier"), tmp_path / "first", 2, every_epoch(tmp_path / "saved", save_last="link"))
    last = tmp_path / "saved" / "last.ckpt"
    assert last.is_symlink() and not Path(f"{last}.offload").exists()
    resumed = Task(tmp_path / "tier-resumed")
    fit(resumed, tmp_path / "resumed", EPOCHS, every_epoch(tmp_path / "saved", save_last="link"), ckpt_path="last")
    assert_same_weights(resumed, uninterrupted)

    # The first epoch's file, copied beside the second epoch's directory: refused, nothing loaded.
    first, second = sorted((tmp_path / "saved").glob("epoch=[01]-*.ckpt"))
    mixed = tmp_path / "mixed.ckpt"
    shutil.copy(first, mixed)
    shutil.copytree(f"{second}.offload", f"{mixed}.offload")
    with pytest.raises(ValueError, match=r"is another save's .*Copy or move the file together with the \.offload"):
        fit(Task(tmp_path / "tier-mixed"), tmp_path / "mixed", EPOCHS, ckpt_path=mixed)


def test_a_file_an_earlier_version_saved_loads_from_the_directory_beside_it(tmp_path: Path,
                                                                          uninterrupted: Task) -> None:
    """Before the directory beside a file held one per save, it was the one checkpoint itself and
    the marker ``True``: such a pair still resumes exactly."""
    fit(Task(tmp_path / "tier"), tmp_path / "first", 1, every_epoch(tmp_path / "saved"))
    (saved,) = (tmp_path / "saved").glob("*.ckpt")
    checkpoint = torch.load(saved, weights_only=False)
    (marker,) = checkpoint["optimizer_states"]
    checkpoint["optimizer_states"] = [{OffloadStrategy.marker: True}]
    earlier = tmp_path / "earlier.ckpt"
    torch.save(checkpoint, earlier)
    shutil.copytree(Path(f"{saved}.offload") / marker[OffloadStrategy.marker], f"{earlier}.offload")
    resumed = Task(tmp_path / "tier-resumed")
    fit(resumed, tmp_path / "resumed", EPOCHS, ckpt_path=earlier)
    assert_same_weights(resumed, uninterrupted)
