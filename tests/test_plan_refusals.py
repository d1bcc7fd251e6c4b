"""What ``OffloadModel`` refuses of a model's dtypes under a compute dtype (a batch norm in neither
float32 nor the compute dtype; a parameter narrower than it: Note: [Masters narrower than the
compute dtype] in ``offload/streams/dtype_refusals.py``), ``estimate_memory`` refuses with its
words, and ``offload plan`` neither chooses nor prints: a plan for a model that cannot be built
would mislead."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import OffloadModel, estimate_memory
from offload.cli.main import main


def _mixed() -> nn.Sequential:
    """float16 layers and a bfloat16 one, then a float16 batch norm: which the model names first
    depends on the cut."""
    return nn.Sequential(nn.Linear(8, 8).half(), nn.Linear(8, 8).half(), nn.Linear(8, 8).bfloat16(),
                         nn.BatchNorm1d(8).half())


def _frozen_half() -> nn.Sequential:
    layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).half())
    layers[1].requires_grad_(False)  # refused too: requires_grad may be switched on after wrapping
    return layers


REFUSED: dict[str, tuple[Callable[[], nn.Sequential], torch.dtype, int]] = {
    "float64 batch norm under bf16": (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8).double()),
                                      torch.bfloat16, 2),
    "float16 batch norm under bf16": (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8).half()),
                                      torch.bfloat16, 1),
    "bf16 layer under fp16": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).bfloat16()), torch.float16, 2),
    "mixed, one slice": (_mixed, torch.bfloat16, 1),
    "mixed, two slices": (_mixed, torch.bfloat16, 2),
    "mixed, three slices": (_mixed, torch.bfloat16, 3),
    "frozen fp16 layer under bf16": (_frozen_half, torch.bfloat16, 2),
}

ACCEPTED: dict[str, tuple[Callable[[], nn.Sequential], torch.dtype]] = {
    "float32 batch norm under bf16": (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), torch.bfloat16),
    "float64 layer under bf16": (lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).double()), torch.bfloat16),
    "bf16 model under bf16": (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).bfloat16(), torch.bfloat16),
    "fp16 batch norm under fp16": (lambda: nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8).half()), torch.float16),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_estimate_memory_refuses_what_the_model_refuses_with_its_words(case):
    make, compute_dtype, num_slices = REFUSED[case]
    with pytest.raises(ValueError) as built:
        OffloadModel(make(), device="cpu", num_slices=num_slices, compute_dtype=compute_dtype)
    with pytest.raises(ValueError) as estimated:
        estimate_memory(make(), num_slices=num_slices, compute_dtype=compute_dtype, device="cpu")
    assert str(estimated.value) == str(built.value)


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_estimate_memory_plans_what_the_model_builds(case):
    make, compute_dtype = ACCEPTED[case]
    OffloadModel(make(), device="cpu", num_slices=2, compute_dtype=compute_dtype)
    assert estimate_memory(make(), num_slices=2, compute_dtype=compute_dtype, device="cpu").host_total > 0


FACTORY = """import torch
from torch import nn


def float64_norm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16).double(), nn.Linear(16, 16).double())


def float32_norm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 16))


def bfloat16_layer():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16).bfloat16())
"""
MODULE = "plan_refusals_factory"


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The models above, importable as ``--model plan_refusals_factory:NAME`` from the working directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no calibration: --gpu's rates
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{MODULE}.py").write_text(FACTORY)
    sys.modules.pop(MODULE, None)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield __import__(MODULE)
    sys.modules.pop(MODULE, None)


def _plan(capsys: pytest.CaptureFixture[str], name: str, *flags: str) -> str:
    main(["plan", "--model", f"{MODULE}:{name}", "--input-shape", "16", "--gpu", "h100-sxm", "--host-memory", "8",
          *flags])
    return capsys.readouterr().out


def _refusal(make: Callable[[], nn.Module], compute_dtype: torch.dtype) -> str:
    with pytest.raises(ValueError) as refused:
        OffloadModel(make(), device="cpu", num_slices=1, compute_dtype=compute_dtype)
    return str(refused.value)


def test_plan_leaves_out_a_compute_dtype_the_model_refuses_and_says_why(factory, capsys):
    """Without --compute-dtype the planner tries bfloat16 beside none; a model OffloadModel refuses
    under bfloat16 is planned without one, and the printed call builds."""
    plan = json.loads(_plan(capsys, "float64_norm", "--json"))
    assert {c["compute_dtype"] for c in plan["candidates"]} == {None}
    why = _refusal(factory.float64_norm, torch.bfloat16)
    assert plan["refused_compute_dtype"] == {"compute_dtype": "bfloat16", "reason": why}
    chosen = plan["chosen"]
    assert "compute_dtype" not in chosen["code"]
    OffloadModel(factory.float64_norm(), device="cpu", num_slices=chosen["num_slices"],
                 num_microbatches=chosen["num_microbatches"], resident_slices=chosen["resident_slices"])
    text = _plan(capsys, "float64_norm")
    assert f"compute dtype: none, the model's own: OffloadModel refuses it under bfloat16 ({why})" in text
    assert "compute_dtype=" not in text.split("model = OffloadModel(")[1]


def test_plan_tries_bfloat16_for_a_model_that_builds_under_it(factory, capsys):
    plan = json.loads(_plan(capsys, "float32_norm", "--json"))
    assert {c["compute_dtype"] for c in plan["candidates"]} == {None, "bfloat16"}
    assert plan["refused_compute_dtype"] is None
    assert "compute dtype:" not in _plan(capsys, "float32_norm")


@pytest.mark.parametrize(("name", "flag", "compute_dtype"), [("float64_norm", "bf16", torch.bfloat16),
                                                             ("bfloat16_layer", "fp16", torch.float16)],
                         ids=["float64-norm-under-bf16", "bf16-layer-under-fp16"])
def test_plan_refuses_a_fixed_compute_dtype_the_model_refuses_in_its_words(factory, capsys, name, flag,
                                                                          compute_dtype):
    with pytest.raises(SystemExit) as exit_info:
        _plan(capsys, name, "--compute-dtype", flag)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"offload plan: error: --compute-dtype {flag}: OffloadModel refuses the model under it: "
                   f"{_refusal(getattr(factory, name), compute_dtype)}; or plan with --compute-dtype none")
