"""Planner and calibrate edges: the estimate against the footprint where a tied weight's holder has
a gradient file, ``amsgrad``'s third state tensor, microbatch counts that are not powers of two,
and ``offload plan`` / ``offload calibrate`` refusals and failures said in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from offload import DiskTier, OffloadModel, estimate_memory
from offload.cli.main import main
from offload.cli.plan import parse_args, run_plan
from offload.planning.choose import least_needs, microbatch_counts

from .helpers import footprint_after_steps
from .test_memory import TiedHead

GIB = 2**30
TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096,
              "tie_word_embeddings": False}


def _tied_apart() -> nn.Sequential:
    """One layer a slice: the embedding, two untied slices, the head borrowing its weight behind
    a norm of its own (its landing buffer larger than the embedding's gradient, as a Llama's)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(4000, 80)
    head = nn.Sequential(nn.LayerNorm(80), TiedHead(embedding))
    return nn.Sequential(embedding, nn.Linear(80, 80), nn.Linear(80, 80), head)


def test_with_the_masters_on_disk_a_tied_holder_takes_no_landing_buffer_of_its_own(tmp_path):
    """The holder's part stays in its gradient file and the sum in the head's buffer, which
    ``host_gradients`` counts (Note: [A tied weight's gradients summed in place]): the window
    holds no buffer of the embedding's size beside it."""
    plan = estimate_memory(_tied_apart(), num_slices=4, compute_dtype=torch.bfloat16, device="cpu", masters="disk")
    layers = _tied_apart()
    model = OffloadModel(layers, device="cpu", num_slices=4, compute_dtype=torch.bfloat16, masters=DiskTier(tmp_path))
    footprint = footprint_after_steps(model, lambda: torch.randint(0, 4000, (2, 3)), steps=3, fused=True)
    # Compared with the .grad's storage: the measured host_gradients also counts the gradient
    # files' pages the page cache still holds at that moment.
    assert plan.host_gradients == layers[0].weight.grad.untyped_storage().nbytes()
    # The pool also keeps the small boundary activations the plan was not told about.
    activations = 4 * 2 * 3 * 80 * 4
    assert plan.host_pool_idle <= footprint.host_pool_idle <= plan.host_pool_idle + activations


def test_the_microbatch_counts_tried_are_the_batchs_divisors_up_to_the_limit_and_the_batch():
    assert microbatch_counts(12) == [1, 2, 3, 4, 6, 12]
    assert microbatch_counts(390625) == [1, 5, 25, 390625]  # 5**8: no power of two but 1 divides it
    assert microbatch_counts(1) == [1]
    assert microbatch_counts(2**63 - 1) == [1, 7, 49, 2**63 - 1]  # bounded: no search up to its root


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no calibration: the --gpu defaults
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_LLAMA))
    return tmp_path


def _device_need(*args: str) -> int:
    plan, _, _, limits = run_plan(parse_args(list(args)))
    return least_needs(plan.candidates, limits).device_memory


def test_a_microbatch_count_that_is_no_power_of_two_is_tried_and_said_when_fixed_otherwise(tiny, capsys):
    """A batch of 12 on a device with room for 12 microbatches' activations, not for 4's: the plan
    finds it, and with ``--microbatches 4`` fixed, what would fit names the count."""
    args = ("--hf-config", "tiny.json", "--gpu", "a100", "--batch-size", "12", "--seq-len", "2048")
    twelve, four = _device_need(*args, "--microbatches", "12"), _device_need(*args, "--microbatches", "4")
    assert twelve < four
    limited = (*args, "--device-memory", f"{(twelve + 2**20) / GIB:.6f}")
    plan, _, _, _ = run_plan(parse_args(list(limited)))
    assert plan.chosen is not None and plan.chosen.config.num_microbatches in (3, 6, 12)
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *limited, "--microbatches", "4", "--json"])
    assert exit_info.value.code == 1  # nothing fits with 4
    found = {a["flags"]: a for a in json.loads(capsys.readouterr().out)["alternatives"]}
    counts = [flags for flags in found if flags.startswith("--microbatches ") and flags.split()[1].isdigit()]
    assert len(counts) == 1 and found[counts[0]]["fits"] and int(counts[0].split()[1]) in (6, 12)
