"""Low-bit optimizer classes through OffloadOptimizer: torchao's AdamW8bit and AdamW4bit keep each
moment in 8 or 4 bits with a scale per block, so the host update moves about a quarter (8-bit) or
an eighth (4-bit) of float32 AdamW's state bytes. OffloadOptimizer runs the class unchanged, on
its host worker, one slice at a time: parameters and state equal the same class run on the plain
model, bit for bit (docs/optimizer.md, "Low-bit optimizers")."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from offload import OffloadModel, OffloadOptimizer

torchao_optim = pytest.importorskip("torchao.optim", reason="the lowbit extra (torchao) is not installed")

EXACT = {"rtol": 0, "atol": 0}
# One block size for every class and test: each new shape compiles the class's step once (about
# ten seconds a shape here), and these layers have three.
BLOCK = 256


def layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64))


def train(plain: nn.Module, model: OffloadModel, reference: torch.optim.Optimizer, optimizer: OffloadOptimizer,
          steps: int, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=generator)
        for net, opt in ((plain, reference), (model, optimizer)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    optimizer.synchronize()


def dequantized(value: object) -> object:
    # torchao keeps a moment as a tensor subclass (codes and scales); its float value is the state.
    return value.dequantize() if hasattr(value, "dequantize") else value


def assert_same_state(optimizer: torch.optim.Optimizer, reference: torch.optim.Optimizer,
                      model: nn.Module, plain: nn.Module) -> None:
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q.detach(), **EXACT)
        mine, theirs = optimizer.state[p], reference.state[q]
        assert set(mine) == set(theirs)
        for key in theirs:
            torch.testing.assert_close(dequantized(mine[key]), dequantized(theirs[key]), **EXACT, msg=key)


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_low_bit_adamw_through_offload_optimizer_is_the_class_run_plainly(name):
    cls = getattr(torchao_optim, name)
    plain = layers()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    reference = cls(plain.parameters(), lr=1e-2, block_size=BLOCK)
    optimizer = OffloadOptimizer(model, cls, lr=1e-2, block_size=BLOCK)
    train(plain, model, reference, optimizer, steps=3)
    assert_same_state(optimizer, reference, model, plain)
    # The moments really are low-bit: not float32 tensors under another name.
    state = optimizer.state[next(model.parameters())]
    assert type(state["exp_avg"]) is not torch.Tensor
    # memory_footprint() counts their codes and scales, not the float32 values they stand for.
    float32_state = 2 * 4 * sum(p.numel() for p in model.parameters())
    counted = model.memory_footprint().host_optimizer_state
    assert counted < float32_state / (3 if name == "AdamW8bit" else 5), (counted, float32_state)


def test_low_bit_state_resumes_through_state_dict():
    cls = torchao_optim.AdamW8bit
    plain = layers()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    reference = cls(plain.parameters(), lr=1e-2, block_size=BLOCK)
    optimizer = OffloadOptimizer(model, cls, lr=1e-2, block_size=BLOCK)
    train(plain, model, reference, optimizer, steps=2)
    buffer = io.BytesIO()  # as a user saves it (torchao's state cannot be deep-copied)
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed_model = OffloadModel(layers(), device="cpu", num_slices=2)
    resumed_model.load_state_dict(model.state_dict())
    resumed = OffloadOptimizer(resumed_model, cls, lr=1e-2, block_size=BLOCK)
    resumed.load_state_dict(saved)
    train(plain, resumed_model, reference, resumed, steps=2, seed=1)
    assert_same_state(resumed, reference, resumed_model, plain)


def test_low_bit_state_in_the_disk_tier(tmp_path, monkeypatch):
    from offload.tiers import state_slice

    monkeypatch.setattr(state_slice, "KEPT_IN_RAM_NOTED", set())
    cls = torchao_optim.AdamW8bit
    plain = layers()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    reference = cls(plain.parameters(), lr=1e-2, block_size=BLOCK)
    optimizer = OffloadOptimizer(model, cls, lr=1e-2, block_size=BLOCK, disk_tier=tmp_path)
    # The moments stay in RAM (Note: [Low-bit state stays in RAM]), said once per kind of state.
    with pytest.warns(UserWarning, match="OptimState8bit stays in RAM"):
        train(plain, model, reference, optimizer, steps=3)
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q.detach(), **EXACT)
    # Plain-tensor state (torchao keeps small tensors' moments in float32) is on disk; all of it
    # comes back through state_dict().
    mine, theirs = optimizer.state_dict()["state"], reference.state_dict()["state"]
    assert mine.keys() == theirs.keys()
    for index in theirs:
        assert mine[index].keys() == theirs[index].keys()
        for key in theirs[index]:
            torch.testing.assert_close(dequantized(mine[index][key]), dequantized(theirs[index][key]), **EXACT)
    optimizer.close()


def checkpoint_state_bytes(path) -> int:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata()
    return sum(entry.size.numel() * entry.properties.dtype.itemsize
               for key, entry in metadata.state_dict_metadata.items()
               if key.startswith("optim/") and isinstance(entry, TensorStorageMetadata))


def codes(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[int]:
    """The addresses of the low-bit moments' codes."""
    return [optimizer.state[p]["exp_avg"].codes.data_ptr() for p in model.parameters()
            if hasattr(optimizer.state[p]["exp_avg"], "codes")]


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
@pytest.mark.parametrize("into", ["fresh", "trained", "plain"])
def test_low_bit_state_resumes_through_a_checkpoint(tmp_path, name, into):
    # save_checkpoint writes each moment's codes, scales and code map (Note: [Wrapped state]); a
    # load rebuilds the low-bit moment, into a fresh optimizer too, rather than handing it the
    # float32 tensor it stands for, which the class would go on stepping as a float32 moment.
    from offload import load_checkpoint, save_checkpoint

    cls = getattr(torchao_optim, name)
    plain = layers()
    model = OffloadModel(copy.deepcopy(plain), device="cpu", num_slices=2)
    reference = cls(plain.parameters(), lr=1e-2, block_size=BLOCK)
    optimizer = OffloadOptimizer(model, cls, lr=1e-2, block_size=BLOCK)
    train(plain, model, reference, optimizer, steps=2)
    save_checkpoint(tmp_path / "step-2", model, optimizer)
    # The moments' own bytes, not the float32 values they stand for.
    float32_state = 2 * 4 * sum(p.numel() for p in model.parameters())
    assert checkpoint_state_bytes(tmp_path / "step-2") < float32_state / (3 if name == "AdamW8bit" else 5)

    resumed_model = OffloadModel(layers(), device="cpu", num_slices=2)
    resumed = OffloadOptimizer(resumed_model, cls, lr=1e-2, block_size=BLOCK)
    if into == "trained":  # the held moments are loaded in place
        train(layers(), resumed_model, cls(layers().parameters(), lr=1e-2, block_size=BLOCK), resumed, steps=1,
              seed=7)
        held = codes(resumed, resumed_model)
    load_checkpoint(tmp_path / "step-2", resumed_model, resumed)
    if into == "trained":
        assert codes(resumed, resumed_model) == held
    # torchao keeps small tensors' moments in float32: each moment of the kind the class made.
    kinds = [type(reference.state[q]["exp_avg"]) for q in plain.parameters()]
    assert [type(resumed.state[p]["exp_avg"]) for p in resumed_model.parameters()] == kinds
    assert torch.Tensor in kinds and len(set(kinds)) == 2
    train(plain, resumed_model, reference, resumed, steps=2, seed=1)
    assert_same_state(resumed, reference, resumed_model, plain)

    if into == "plain":  # the same checkpoint into the plain model and the class itself
        again = layers()
        direct = cls(again.parameters(), lr=1e-2, block_size=BLOCK)
        load_checkpoint(tmp_path / "step-2", again, direct)
        assert [type(direct.state[p]["exp_avg_sq"]) for p in again.parameters()] == kinds


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit"])
def test_low_bit_adamw_under_a_compute_dtype_is_the_class_run_plainly(name):
    # The class's step is compiled whole (fullgraph), which no dispatch mode may wrap: the one-pass
    # update (Note: [One-pass update]) stays out, and the shadow is cast after the step. The plain
    # side is an OffloadModel of the same compute dtype, stepped by the class itself.
    cls = getattr(torchao_optim, name)
    plain = OffloadModel(layers(), device="cpu", num_slices=2, compute_dtype=torch.bfloat16)
    model = OffloadModel(layers(), device="cpu", num_slices=2, compute_dtype=torch.bfloat16)
    reference = cls(plain.parameters(), lr=1e-2, block_size=BLOCK)
    optimizer = OffloadOptimizer(model, cls, lr=1e-2, block_size=BLOCK)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(16, 64, generator=generator)
        for net, opt in ((plain, reference), (model, optimizer)):
            opt.zero_grad()
            net(x).float().square().mean().backward()
            opt.step()
    optimizer.synchronize()
    assert_same_state(optimizer, reference, model, plain)
    # The next forward reads shadows cast from the stepped masters: the same outputs.
    torch.testing.assert_close(model(x), plain(x), **EXACT)
