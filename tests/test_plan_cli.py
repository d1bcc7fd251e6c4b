"""``offload plan``'s answers to bad input (one line on stderr, exit status 2, no traceback), its
import of ``--model``'s factory from the directory the user is in, and what it says would fit when
nothing does (each figure from a plan re-run with one option changed)."""

from __future__ import annotations

import ast
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from offload.cli.main import main
from offload.cli.plan import Planner, machine_limits, machine_rates, parse_args, run_plan
from offload.cli.plan_alternatives import Alternative
from offload.planning.choose import gib, least_needs
from offload.planning.rates import GPU_DEFAULTS

GIB = 2**30

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
              "tie_word_embeddings": False}
FACTORY = "from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))\n"


def _without_import_noise(stderr: str) -> str:
    """``stderr`` less what importing torchao and bitsandbytes prints (transformers and peft import
    them when installed): torchao's C extensions built for another torch, torch's notes on its enums."""
    noise = ("Failed to load", "is an Enum subclass and is now natively supported by torch.compile")
    return "".join(line for line in stderr.splitlines(keepends=True)
                   if not (("torchao" in line or "_pytree.py" in line) and any(n in line for n in noise)))


def plan_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """``offload plan ARGS``'s error line, checked to be the only line, with exit status 2."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    err = _without_import_noise(capsys.readouterr().err)
    assert exit_info.value.code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("offload plan: error: "), lines[0]
    return lines[0]


@pytest.fixture(autouse=True)
def no_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty cache for every test here: the rates `offload calibrate` saved on this machine, if it
    ever ran, would change what the planner prints."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory of good and bad inputs, the working directory, with no calibration in the cache."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "truncated.json").write_text(json.dumps(TINY_LLAMA)[:-20])
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 2, "intermediate_size": 128}))
    (tmp_path / "no_type.json").write_text(json.dumps({"hidden_size": 64}))
    (tmp_path / "a list.json").write_text("[1, 2]")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}\xff\xfe" * 4)
    (tmp_path / "odd_heads.json").write_text(json.dumps(TINY_LLAMA | {"hidden_size": 65}))
    (tmp_path / "negative.json").write_text(json.dumps(TINY_LLAMA | {"intermediate_size": -3}))
    (tmp_path / "no_config").mkdir()
    (tmp_path / "a_file").write_text("")
    (tmp_path / "rates_not_json.json").write_text("not json")
    (tmp_path / "rates_other_version.json").write_text(json.dumps({"device_tflops": 1}))
    (tmp_path / "plan_cli_factory.py").write_text(FACTORY)
    (tmp_path / "plan_cli_no_params.py").write_text("from torch import nn\n\n\ndef build():\n"
                                                    "    return nn.Sequential(nn.ReLU(), nn.Tanh())\n")
    (tmp_path / "plan_cli_broken.py").write_text("def build(:\n")
    (tmp_path / "plan_cli_raises.py").write_text("def build():\n    raise RuntimeError('no weights here')\n")
    (tmp_path / "plan_cli_embedding.py").write_text("from torch import nn\n\n\ndef build():\n"
                                                    "    return nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8))\n")
    (tmp_path / "gpt2.json").write_text(json.dumps(GPT2))
    # As `offload calibrate` without --dir writes them: the disk not measured.
    no_disk = {"no_disk": {"disk_read": None, "disk_write": None}}
    cpu = {"no_link": {"host_to_device": 0.0},
           "old_cpu": {"name": "calibrated: CPU vm (2 cores)", "device_memory": None}}
    for name, change in (BAD_RATES | RATES_OF_ANOTHER_SHAPE | cpu | no_disk).items():
        (tmp_path / f"rates_{name}.json").write_text(json.dumps(GPU_DEFAULTS["a100"].to_json() | change))
    yield tmp_path
    for module in ("plan_cli_factory", "plan_cli_no_params", "plan_cli_broken", "plan_cli_raises",
                   "plan_cli_embedding"):
        sys.modules.pop(module, None)


TINY = ("--hf-config", "tiny.json", "--gpu", "a100", "--host-memory", "8")
#: GPT-2 learns an embedding per position: a sequence past n_positions indexes past the table.
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128,
        "bos_token_id": 0, "eos_token_id": 0}
#: Rates files with one rate a step's time cannot be divided by.
BAD_RATES = {"zero": {"host_update": 0}, "null": {"device_to_host": None}, "text": {"host_to_device": "fast"},
             "negative": {"host_copy": -1e9}, "zero_flops": {"device_flops": {"float32": 0}},
             "infinite": {"disk_read": float("inf")}}
#: Rates files whose fields are not what a plan reads: no float32 rate to time a float32 step (or
#: a dtype not measured) with, and sources that --gpu cannot merge into its own.
RATES_OF_ANOTHER_SHAPE = {"no_flops": {"device_flops": {}}, "no_float32": {"device_flops": {"bfloat16": 1e14}},
                          "sources_a_list": {"sources": ["calibrate"]}, "name_a_number": {"name": 5}}

BAD_INPUTS = {
    # The step.
    "negative batch": ([*TINY, "--batch-size", "-4"], "--batch-size must be at least 1"),
    "zero batch": ([*TINY, "--batch-size", "0"], "--batch-size must be at least 1"),
    "zero seq-len": ([*TINY, "--seq-len", "0"], "--seq-len must be at least 1"),
    "not a number": ([*TINY, "--batch-size", "eight"], "invalid int value"),
    "zero slices": ([*TINY, "--num-slices", "0"], "--num-slices must be at least 1"),
    "more slices than stages": ([*TINY, "--num-slices", "1000"], "--num-slices 1000 is more than the model's 6 stages"),
    "more resident than stages": ([*TINY, "--resident-slices", "100"], "--resident-slices 100 is more than"),
    "microbatches not dividing": ([*TINY, "--microbatches", "3"], "--microbatches 3 does not divide --batch-size 8"),
    "negative rank": ([*TINY, "--lora-r", "-1"], "--lora-r must be 0"),
    "negative chunk": ([*TINY, "--loss-chunk-tokens", "-1"], "--loss-chunk-tokens must be 0"),
    "zero clipping": ([*TINY, "--max-grad-norm", "0"], "--max-grad-norm must be a finite number above 0"),
    # offload-finetune refuses it: the printed command would not run.
    "infinite clipping": ([*TINY, "--max-grad-norm", "inf"], "--max-grad-norm must be a finite number above 0"),
    "one token a row": ([*TINY, "--seq-len", "1"], "--seq-len must be at least 2"),
    "past gpt2's positions": (["--hf-config", "gpt2.json", "--gpu", "a100", "--seq-len", "4096"],
                              "--seq-len 4096 is more than the 128 positions of --hf-config gpt2.json"),
    "no rows": ([*TINY, "--top", "0"], "--top must be at least 1"),
    # The machine.
    "negative host": ([*TINY[:4], "--host-memory", "-5"], "--host-memory must be a positive number of GiB, got -5"),
    "zero device": ([*TINY, "--device-memory", "0"], "--device-memory must be a positive number of GiB"),
    "zero disk": ([*TINY, "--disk-dir", ".", "--disk", "0"], "--disk must be a positive number of GiB, got 0"),
    "negative disk": ([*TINY, "--disk-dir", ".", "--disk", "-3"], "--disk must be a positive number of GiB"),
    "disk without a dir": ([*TINY, "--disk", "10"], "--disk is the space under --disk-dir"),
    "disk dir a file": ([*TINY, "--disk-dir", "a_file"], "--disk-dir a_file: not a directory"),
    # A disk tier makes only the last level: the printed DiskTier(...) would be refused.
    "disk dir without its parent": ([*TINY, "--disk-dir", "none/a/b"], "its parent directory"),
    # "Create it first" could not be followed: a file stands where a directory must.
    "disk dir under a file": ([*TINY, "--disk-dir", "a_file/tier"],
                              "a_file is a file, not a directory; choose another path"),
    "infinite host": ([*TINY[:4], "--host-memory", "inf"], "--host-memory must be a positive number of GiB, got inf"),
    "infinite device": ([*TINY, "--device-memory", "inf"], "--device-memory must be a positive number of GiB"),
    "infinite disk": ([*TINY, "--disk-dir", ".", "--disk", "inf"], "--disk must be a positive number of GiB"),
    "infinite pinned": ([*TINY, "--pinned-memory", "inf"], "--pinned-memory must be a positive number of GiB"),
    "huge host": ([*TINY[:4], "--host-memory", "1e300"], "--host-memory must be a positive number of GiB, got 1e+300 "
                  "(below 8589934592 GiB"),
    **{f"rates with a {name} rate": ([*TINY, "--rates", f"rates_{name}.json"], "must be a number")
       for name in BAD_RATES},
    "rates without device rates": ([*TINY[:2], "--device", "cpu", "--host-memory", "8", "--rates",
                                    "rates_no_flops.json"],
                                   "--rates rates_no_flops.json: rates file: device_flops has no float32 rate, got {}"),
    "rates without a float32 rate": ([*TINY, "--rates", "rates_no_float32.json"],
                                     "rates file: device_flops has no float32 rate, got "
                                     "{\"bfloat16\": 100000000000000.0}"),
    "rates with sources a list": ([*TINY, "--rates", "rates_sources_a_list.json"],
                                  "rates file: sources must map rate names to where each came from, got "
                                  "[\"calibrate\"]"),
    "rates with a name a number": ([*TINY, "--rates", "rates_name_a_number.json"], "rates file: name must be text"),
    # A CPU device's rates (no link) plan no GPU: its loads would take no time. Those `offload
    # calibrate` wrote on a CPU before it wrote 0 for the link carry the copy rate there, and its name.
    "rates without a link for a gpu": ([*TINY[:2], *TINY[4:], "--rates", "rates_no_link.json"],
                                       "--rates rates_no_link.json: rates of a CPU device, no link rates"),
    "rates calibrated on a cpu for a gpu": ([*TINY[:2], *TINY[4:], "--rates", "rates_old_cpu.json"],
                                            "--rates rates_old_cpu.json: rates of a CPU device, no link rates"),
    # A GPU's rates time no CPU device: its matmuls would be the GPU's.
    "rates of a gpu for a cpu": ([*TINY[:2], "--device", "cpu", "--host-memory", "8", "--rates",
                                  "rates_no_disk.json"],
                                 "--rates rates_no_disk.json: rates of a GPU (a100), which time no CPU device: run "
                                 "`python -m offload calibrate --device cpu --out FILE`"),
    # A calibration without --dir times no disk tier: refused before planning, not a traceback.
    "disk dir with rates without the disk's": ([*TINY, "--rates", "rates_no_disk.json", "--disk-dir", "."],
                                               "--rates rates_no_disk.json: no disk rates (disk_read, disk_write) "
                                               "to plan a disk tier with: run `python -m offload calibrate --dir . "
                                               "--out rates_no_disk.json`"),
    "unknown gpu": ([*TINY, "--gpu", "rtx-9090"], "argument --gpu: invalid choice: 'rtx-9090'"),
    "cpu uncalibrated": ([*TINY[:2], "--device", "cpu", "--host-memory", "8"], "--device cpu needs this CPU's"),
    "no rates": (list(TINY[:2]), "no rates: run `python -m offload calibrate`"),
    "rates missing": ([*TINY, "--rates", "none.json"], "--rates none.json: no such file"),
    "rates a directory": ([*TINY, "--rates", "no_config"], "--rates no_config: a directory, not a rates file"),
    "rates not json": ([*TINY, "--rates", "rates_not_json.json"], "--rates rates_not_json.json: Expecting value"),
    "rates of another version": ([*TINY, "--rates", "rates_other_version.json"], "unknown fields ['device_tflops']"),
    # --hf-config.
    "config missing": (["--hf-config", "none.json", "--gpu", "a100"], "--hf-config none.json: no such file"),
    "config dir without one": (["--hf-config", "no_config", "--gpu", "a100"], "the directory holds no config.json"),
    "config not json": (["--hf-config", "truncated.json", "--gpu", "a100"], "--hf-config truncated.json: not a JSON config"),
    # The config's own mistakes before the rates': without a calibration, they were answered "no rates".
    "config not json without rates": (["--hf-config", "truncated.json"], "--hf-config truncated.json: not a JSON config"),
    "json text not json without rates": (["--hf-config", "{bad json"], "--hf-config {bad json: not a JSON config"),
    "config a text file without rates": (["--hf-config", "plan_cli_factory.py"],
                                         "--hf-config plan_cli_factory.py: not a JSON config"),
    # A weights file or a Hub id where the config belongs: the error says what to give.
    "config a weights file": (["--hf-config", "model.safetensors"], "--hf-config model.safetensors: not a JSON config "
                              "('utf-8' codec can't decode byte 0xff in position 10: invalid start byte); give the "
                              "model's config.json, the folder holding it, or its JSON text"),
    "config a hub id": (["--hf-config", "meta-llama/Llama-3.1-8B"], "--hf-config meta-llama/Llama-3.1-8B: no such "
                        "file or directory, and not JSON: give a config.json, the folder holding it, or its JSON text "
                        "(a Hub id is not fetched: download the model's config.json)"),
    "config not a causal LM without rates": (["--hf-config", "bert.json"], "model_type 'bert' is not a causal LM"),
    "config not a causal LM": (["--hf-config", "bert.json", "--gpu", "a100"], "model_type 'bert' is not a causal LM"),
    "config without a type": (["--hf-config", "no_type.json", "--gpu", "a100"], "the config has no model_type"),
    "config a list": (["--hf-config", "a list.json", "--gpu", "a100"], "the config has no model_type"),
    "config of an unknown type": (["--hf-config", '{"model_type": "llama9"}', "--gpu", "a100"], "'llama9' is not"),
    "config sizes refused": (["--hf-config", "odd_heads.json", "--gpu", "a100"], "not a multiple of the number"),
    # Sizes checked before the model is built: a 0 divides by zero in its __init__ (a traceback, once).
    "config size negative": (["--hf-config", "negative.json", "--gpu", "a100"],
                             "--hf-config negative.json: intermediate_size must be a positive integer, got -3"),
    "config size zero": (["--hf-config", '{"model_type": "llama", "hidden_size": 0}', "--gpu", "a100"],
                         "hidden_size must be a positive integer, got 0; give the size of the model to plan"),
    "config kv heads zero": (["--hf-config", json.dumps(TINY_LLAMA | {"num_key_value_heads": 0}), "--gpu", "a100"],
                             "num_key_value_heads must be a positive integer, got 0"),
    # Grouped-query attention: each key and value head serves as many query heads (found, before,
    # only by the profile's first attention: a traceback).
    "config kv heads not dividing": (["--hf-config", json.dumps(TINY_LLAMA | {"num_key_value_heads": 3}), "--gpu",
                                      "a100"], "num_key_value_heads 3 does not divide num_attention_heads 4"),
    "config kv heads more than heads": (["--hf-config", json.dumps(TINY_LLAMA | {"num_key_value_heads": 8}),
                                         "--gpu", "a100"], "num_key_value_heads 8 does not divide num_attention_heads 4"),
    # Sizes past int64, which torch refuses in C++ (its frames in the message), and tensors whose
    # bytes are past it: the flags named, in one line.
    **{f"{flag} past int64": ([*args, flag, str(10**20), "--gpu", "a100"],
                              f"argument {flag}: 100000000000000000000 is more than 2**63-1")
       for flag, args in (("--batch-size", TINY[:2]), ("--seq-len", TINY[:2]), ("--loss-chunk-tokens", TINY[:2]),
                          ("--input-shape", ("--model", "plan_cli_factory:build")),
                          ("--vocab", ("--model", "plan_cli_factory:build", "--input-shape", "8")))},
    "set past int64": (["--preset", "tiny", "--set", f"width={10**20}", "--gpu", "a100"],
                       f"preset 'tiny': width must be an int of at least 1 (and at most 2**63-1), got {10**20}"),
    "set past int64's bytes": (["--preset", "tiny", "--set", f"width={2**62}", "--gpu", "a100"],
                               f"--preset tiny --set width={2**62} --batch-size 8: Storage size calculation overflowed"),
    "batch past int64's bytes": (["--preset", "tiny", "--batch-size", str(2**62), "--gpu", "a100"],
                                 f"--preset tiny --batch-size {2**62}: Storage size calculation overflowed"),
    "model input past int64's bytes": (["--model", "plan_cli_factory:build", "--input-shape", str(2**62), "--gpu",
                                        "a100"], f"--batch-size 8 --input-shape {2**62} for --model "
                                                 "plan_cli_factory:build: Storage size calculation overflowed"),
    "tokens past int64's bytes": ([*TINY, "--batch-size", str(10**9), "--seq-len", str(10**9)],
                                  f"--hf-config tiny.json --batch-size {10**9} --seq-len {10**9}: profiling layer 0 "
                                  "(LlamaEmbedding) on fake tensors failed: Storage size calculation overflowed"),
    "lora without hf": (["--preset", "tiny", "--gpu", "a100", "--lora-r", "4"], "--lora-r adapts a Hugging Face"),
    # Given, 0 too: the flag means nothing without --hf-config.
    "lora 0 without hf": (["--preset", "tiny", "--gpu", "a100", "--lora-r", "0"], "--lora-r adapts a Hugging Face"),
    # --seq-len shapes only --hf-config's input: elsewhere it would be ignored, the plan not the one typed.
    "seq-len with a preset": (["--preset", "tiny", "--gpu", "a100", "--seq-len", "64"],
                              "--seq-len is --hf-config's tokens per row"),
    "seq-len with a model": (["--model", "plan_cli_factory:build", "--input-shape", "8", "--gpu", "a100",
                              "--seq-len", "64"], "--seq-len is --hf-config's tokens per row"),
    # As --seq-len: only --hf-config's head computes its loss in chunks; the value was ignored.
    "loss chunks with a preset": (["--preset", "tiny", "--gpu", "a100", "--loss-chunk-tokens", "7"],
                                  "--loss-chunk-tokens chunks --hf-config's loss; the head of a preset or --model is "
                                  "not chunked"),
    "loss chunks with a model": (["--model", "plan_cli_factory:build", "--input-shape", "8", "--gpu", "a100",
                                  "--loss-chunk-tokens", "0"], "--loss-chunk-tokens chunks --hf-config's loss"),
    # --preset and --model.
    "two models": ([*TINY, "--preset", "tiny"], "give the model as one of"),
    "set not key=value": (["--preset", "mlp", "--set", "width", "--gpu", "a100"], "--set takes KEY=VALUE"),
    "set unknown": (["--preset", "mlp", "--set", "span=3", "--gpu", "a100"], "preset 'mlp' has no setting 'span'"),
    "set out of range": (["--preset", "mlp", "--set", "width=-1", "--gpu", "a100"], "width must be an int of at least"),
    "set without preset": ([*TINY, "--set", "width=3"], "--set sets a --preset's settings"),
    "model without shape": (["--model", "plan_cli_factory:build", "--gpu", "a100"], "--model needs --input-shape"),
    "shape without model": ([*TINY, "--input-shape", "8"], "--input-shape and --vocab describe --model's input"),
    "shape of zero": (["--model", "plan_cli_factory:build", "--input-shape", "0", "--gpu", "a100"], "--input-shape must"),
    "wrong shape": (["--model", "plan_cli_factory:build", "--input-shape", "3", "5", "--gpu", "a100"],
                    "--input-shape 3 5 for --model plan_cli_factory:build: profiling layer 0 (Linear)"),
    # Fake tensors multiply token ids by a float weight; a real first batch would not.
    "token ids into a linear layer": (["--model", "plan_cli_factory:build", "--input-shape", "8", "--vocab", "10",
                                       "--gpu", "a100"],
                                      "--input-shape 8 --vocab 10 for --model plan_cli_factory:build: profiling layer "
                                      "0 (Linear) on fake tensors failed: addmm of float32 and int64 operands: a "
                                      "matrix multiply takes one dtype, and a real run refuses it"),
    # Fake tensors read no index; a real first batch indexes past the table (IndexError).
    "token ids past the embedding": (["--model", "plan_cli_embedding:build", "--input-shape", "8", "--vocab", "101",
                                      "--gpu", "a100"],
                                     "--vocab 101 is more than the 100 rows of layer 0 (nn.Embedding) of --model "
                                     "plan_cli_embedding:build"),
    "model not a spec": (["--model", "plan_cli_factory", "--input-shape", "8", "--gpu", "a100"], "must look like"),
    "model not importable": (["--model", "no_such_module:build", "--input-shape", "8", "--gpu", "a100"],
                             "cannot import 'no_such_module'"),
    "model without factory": (["--model", "plan_cli_factory:make", "--input-shape", "8", "--gpu", "a100"],
                              "has no callable 'make'"),
    "model without parameters": (["--model", "plan_cli_no_params:build", "--input-shape", "8", "--gpu", "a100"],
                                 "returned an nn.Sequential without parameters"),
    "model not python": (["--model", "plan_cli_broken:build", "--input-shape", "8", "--gpu", "a100"],
                         "cannot import 'plan_cli_broken' for --model plan_cli_broken:build: invalid syntax"),
    "model factory raises": (["--model", "plan_cli_raises:build", "--input-shape", "8", "--gpu", "a100"],
                             "--model plan_cli_raises:build: the factory raised RuntimeError: no weights here"),
    "model as a file's path": (["--model", "./plan_cli_factory.py:build", "--input-shape", "8", "--gpu", "a100"],
                               "--model takes a module's name, not a file's path: for ./plan_cli_factory.py, run "
                               "from its directory and give --model plan_cli_factory:build"),
    # The plan's batch is --batch-size's: a preset's own would be printed in the code, not planned.
    "preset's batch": (["--preset", "tiny", "--gpu", "a100", "--set", "batch_size=3"],
                       "--set batch_size=3: give the batch as --batch-size 3"),
    # A GPU's rates would time a CPU device at the GPU's speed.
    "gpu for a cpu device": ([*TINY, "--device", "cpu"], "--gpu a100 plans that GPU, and --device cpu a CPU device"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_a_bad_input_is_one_line_with_exit_status_2(case, inputs, capsys):
    args, fragment = BAD_INPUTS[case]
    assert fragment in plan_error(capsys, *args)


@pytest.mark.parametrize("change", [{"hidden_size": 0}, {"num_key_value_heads": 0}])
def test_a_size_that_divides_by_zero_in_the_build_is_one_line_unchecked_too(change, inputs, capsys, monkeypatch):
    """Behind the sizes' check, the build's ZeroDivisionError is answered as transformers' refusals are."""
    import offload.cli.plan_models

    monkeypatch.setattr(offload.cli.plan_models, "_check_sizes", lambda spec, config: None)
    config = json.dumps(TINY_LLAMA | change)
    assert plan_error(capsys, "--hf-config", config, "--gpu", "a100").startswith(f"offload plan: error: --hf-config "
                                                                                  f"{config}: ")


def test_a_planner_failure_on_a_valid_config_is_not_told_as_the_flags_error(inputs, monkeypatch):
    """A config's and a preset's layers are not the user's: their forward failing on sizes torch can
    hold is the planner's fault (as torch 2.11's attention count refusing grouped-query shapes was),
    a traceback to report, not a one-line error blaming the flags."""
    from offload.planning import shapes

    def refuses(*args, **kwargs):
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")

    monkeypatch.setattr(shapes, "_cpu_attention_flop", refuses)
    mapping = shapes._cpu_attention_flops()
    monkeypatch.setattr(shapes, "_cpu_attention_flops", lambda: {op: refuses for op in mapping})
    config = json.dumps(TINY_LLAMA | {"num_key_value_heads": 2})
    with pytest.raises(RuntimeError, match="profiling layer 1"):
        main(["plan", "--hf-config", config, "--gpu", "a100", "--seq-len", "32"])


def test_an_error_line_leaves_out_the_cpp_frames_torch_appends():
    from offload.cli.plan_models import _one_line

    with pytest.raises(TypeError) as error:
        torch.empty(10**20)
    assert "\nException raised from " in str(error.value)  # torch's C++ frames, as their own lines
    assert _one_line(error.value) == str(error.value).splitlines()[0]


def test_vocab_up_to_the_embeddings_rows_and_loss_chunks_for_a_config_are_planned(inputs, capsys):
    main(["plan", "--model", "plan_cli_embedding:build", "--input-shape", "8", "--vocab", "100", "--gpu", "a100",
          "--host-memory", "8"])
    assert "model = OffloadModel(plan_cli_embedding.build()" in capsys.readouterr().out
    # Left out, --hf-config's loss is in offload-finetune's chunks, and the printed command says so.
    for given, chunk in (([], 1024), (["--loss-chunk-tokens", "7"], 7)):
        main(["plan", *TINY, *given, "--json"])
        chosen = json.loads(capsys.readouterr().out)["chosen"]
        assert f"--loss-chunk-tokens {chunk} " in chosen["finetune"]
        assert f"loss_chunk_tokens={chunk})" in chosen["code"]


@pytest.mark.parametrize(("argv", "error"), [(["quantize"], "unknown command 'quantize'"),
                                             ([], "a COMMAND is required")])
def test_an_unknown_or_missing_command_is_a_usage_error(argv, error, capsys):
    """As argparse answers an invalid choice: the usage and the error on stderr, nothing on stdout,
    exit status 2; ``--help`` lists the commands on stdout."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert err.splitlines() == ["usage: offload COMMAND [options]  (offload COMMAND --help for its options)",
                                f"offload: error: {error}: choose from plan, calibrate, finetune"]
    main(["--help"])
    out, err = capsys.readouterr()
    assert "commands:\n  plan " in out and err == ""


def test_plan_imports_the_model_factory_from_the_working_directory(inputs, monkeypatch, capsys):
    # As the `offload` console script starts: its own directory first on the path, not the one the
    # user is in (`python -m offload` would put that one there).
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(inputs))])
    main(["plan", "--model", "plan_cli_factory:build", "--input-shape", "8", "--gpu", "a100", "--host-memory", "8"])
    assert "model = OffloadModel(plan_cli_factory.build()" in capsys.readouterr().out


# -- nothing fits: what would ----------------------------------------------------------------------


def _needs(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[Any, Any]:
    """The plan for ``offload plan ARGS`` and its least needs, from the planner directly."""
    plan, _, _, limits = run_plan(parse_args(list(args)))
    return plan, least_needs(plan.candidates, limits)


def _plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args, "--json"])
    assert exit_info.value.code == 1  # nothing fits
    return json.loads(capsys.readouterr().out)


MLP = ("--preset", "mlp", "--set", "width=1024", "depth=8", "--gpu", "h100-sxm", "--batch-size", "8")


def test_nothing_fits_names_the_options_that_would_with_the_planners_figures(capsys):
    args = (*MLP, "--resident-slices", "0", "--host-memory", "0.05")
    plan, needs = _needs(capsys, *args)
    assert plan.chosen is None
    found = {a["flags"]: a for a in _plan_json(capsys, *args)["alternatives"]}
    # More host memory: the least the planner found, rounded up to the figure printed, and it fits.
    host = [flags for flags in found if flags.startswith("--host-memory ")]
    assert len(host) == 1 and found[host[0]]["fits"]
    assert needs.host_memory <= float(host[0].split()[1]) * GIB < needs.host_memory + 0.01 * GIB
    # The planner's own resident count fits; the disk tier's figures are a plan with the tier.
    assert found["--resident-slices auto"]["fits"]
    _, tiered = _needs(capsys, *args, "--disk-dir", "DIR")
    assert (found["--disk-dir DIR"]["tiered_host_memory"], found["--disk-dir DIR"]["tiered_disk"]) == (
        tiered.tiered_host_memory, tiered.tiered_disk)
    # The text says the same, with the margin.
    with pytest.raises(SystemExit):
        main(["plan", *args])
    out = capsys.readouterr().out
    assert "the figures include the planner's margin: 10% of the host's" in out
    said = {line.split("  needs ")[0].strip(): "needs " + line.split("  needs ")[1]
            for line in out.splitlines() if "  needs " in line}
    assert said[host[0]] == f"needs {gib(needs.host_memory)} of host memory: fits"
    assert said["--disk-dir DIR"].startswith(f"needs {gib(tiered.tiered_host_memory)} of host memory and "
                                             f"{gib(tiered.tiered_disk)} of disk")


def test_for_a_hf_config_it_tries_lora_and_a_shorter_sequence(inputs, capsys):
    # Big enough that the adapters and a shorter sequence change the figures printed (0.01 GiB).
    (inputs / "small.json").write_text(json.dumps(TINY_LLAMA | {"hidden_size": 256, "intermediate_size": 1024,
                                                                "vocab_size": 4096}))
    args = ("--hf-config", "small.json", "--gpu", "a100", "--host-memory", "0.01", "--resident-slices", "0",
            "--seq-len", "1024")
    found = {a["flags"]: a for a in _plan_json(capsys, *args)["alternatives"]}
    for flags in ("--lora-r 16", "--seq-len 64"):
        plan, needs = _needs(capsys, *args, *flags.split())
        assert (found[flags]["fits"], found[flags]["host_memory"]) == (plan.chosen is not None, needs.host_memory)


def test_a_shorter_sequence_is_tried_whatever_microbatches_split_the_batch(inputs, capsys):
    # --microbatches 3 divides the batch of 6 and none of the sequence's halvings: it splits rows only.
    (inputs / "small.json").write_text(json.dumps(TINY_LLAMA | {"hidden_size": 256, "intermediate_size": 1024,
                                                                "vocab_size": 4096}))
    args = ("--hf-config", "small.json", "--gpu", "a100", "--host-memory", "0.01", "--resident-slices", "0",
            "--seq-len", "1024", "--batch-size", "6", "--microbatches", "3")
    found = {a["flags"]: a for a in _plan_json(capsys, *args)["alternatives"]}
    plan, needs = _needs(capsys, *args, "--seq-len", "64")
    assert (found["--seq-len 64"]["fits"], found["--seq-len 64"]["host_memory"]) == (plan.chosen is not None,
                                                                                      needs.host_memory)


def test_left_out_the_sequence_length_is_at_most_a_learned_position_tables(inputs, capsys):
    # 2048 by default, which GPT-2 (positions learned, 128 here) cannot run: its table's size.
    for config, tokens in ((json.dumps(GPT2), 128), ("tiny.json", 2048)):  # tiny: rotary, the default
        main(["plan", "--hf-config", config, "--gpu", "a100", "--json"])
        assert f"--seq-len {tokens} " in json.loads(capsys.readouterr().out)["chosen"]["finetune"]


def test_the_printed_disk_tier_names_the_directory_as_python_and_the_shell_read_it(tmp_path, capsys):
    where = tmp_path / 'a "quoted" dir'
    main(["plan", "--preset", "mlp", "--gpu", "h100-sxm", "--resident-slices", "0", "--host-memory", "0.3",
          "--disk-dir", str(where), "--json"])
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    assert "disk" in (chosen["optimizer_state"], chosen["masters"])
    calls = [node for node in ast.walk(ast.parse(chosen["code"]))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DiskTier"]
    assert calls and all(ast.literal_eval(call.args[0]) == str(where) for call in calls)


def test_when_nothing_fits_the_device_it_says_how_much_would(capsys):
    args = (*MLP, "--host-memory", "8", "--device-memory", "0.001")
    _, needs = _needs(capsys, *args)
    found = {a["flags"]: a for a in _plan_json(capsys, *args)["alternatives"]}
    device = [flags for flags in found if flags.startswith("--device-memory ")]
    assert len(device) == 1 and found[device[0]]["fits"]
    assert needs.device_memory <= float(device[0].split()[1]) * GIB < needs.device_memory + 0.01 * GIB


def test_the_host_figure_counts_the_resident_slices_that_fit_the_device(capsys):
    # Some slices fit the device resident, none fits the host: the figure is that of the resident
    # count that needs the least host memory, so that it typed back as --host-memory fits as printed.
    args = (*MLP, "--host-memory", "0.05", "--device-memory", "0.1")
    _, needs = _needs(capsys, *args)
    host = f"{gib(needs.host_memory).removesuffix(' GiB')}"
    again, needs_again = _needs(capsys, *MLP, "--host-memory", host, "--device-memory", "0.1")
    assert again.chosen is not None and again.chosen.config.resident_slices > 0
    assert gib(needs_again.host_memory) == gib(needs.host_memory)
    found = {a["flags"]: a for a in _plan_json(capsys, *args)["alternatives"]}
    assert found[f"--host-memory {host}"]["host_memory"] == needs.host_memory


def test_a_config_given_as_json_longer_than_a_file_name_is_read_as_json(capsys):
    # Every field a config.json has: more than the 255 bytes a file name may take, which asking the
    # file system whether it is a directory would fail on.
    config = json.dumps(TINY_LLAMA | {"architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
                                      "rope_theta": 500000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
                                      "bos_token_id": 1, "eos_token_id": 2, "attention_dropout": 0.0})
    assert len(config) > 255
    main(["plan", "--hf-config", config, "--gpu", "a100", "--host-memory", "8"])
    assert "model = OffloadModel(" in capsys.readouterr().out


@pytest.mark.parametrize("model_type", ["exaone", "sarvam_moe", "jais2"])
def test_a_model_type_built_as_a_familys_class_is_planned(model_type, capsys):
    """As causal_lm_sequential cuts it (docs/huggingface.md): EXAONE 3 as a Llama, Sarvam-MoE as GLM-4-MoE,
    Jais 2 (a class of its own) with Llama's layout."""
    transformers = pytest.importorskip("transformers")
    if model_type not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    main(["plan", "--hf-config", json.dumps(TINY_LLAMA | {"model_type": model_type}), "--gpu", "a100",
          "--host-memory", "8", "--seq-len", "32", "--batch-size", "2"])
    assert "model = OffloadModel(" in capsys.readouterr().out


#: Llama-3-8B's shapes, as its config.json gives them: docs/planning.md's "When nothing fits".
LLAMA3_8B = ('{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, '
             '"intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, '
             '"num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, '
             '"rms_norm_eps": 1e-05, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": false, '
             '"torch_dtype": "bfloat16"}')


def test_the_nothing_fits_example_of_the_planning_doc_is_what_the_planner_says():
    """The block is the command's output; this checks its two lines that carry the advice (what the
    model needs, and that a disk tier makes it fit) against the planner, without the command's
    subprocess."""
    text = (Path(__file__).resolve().parent.parent / "docs/planning.md").read_text()
    block = re.search(r"on\n`--gpu rtx-4090 --host-memory 64`:\n\n```\n(.*?)```", text, re.S)
    assert block, "the example's block moved: update this test"
    args = parse_args(["--hf-config", LLAMA3_8B, "--gpu", "rtx-4090", "--host-memory", "64", "--batch-size", "8",
                       "--seq-len", "2048"])
    planner = Planner(machine_rates(args))
    limits = machine_limits(args, planner.rates)
    needs = least_needs(planner.plan(args, limits).candidates, limits)
    assert f"nothing fits: needs {gib(needs.host_memory)} of host memory" in block[1]
    tiered_limits = replace(limits, disk_dir="DIR", disk=None)
    tiered_plan = planner.plan(args, tiered_limits)  # the same planner: the model's profiles are reused
    tiered = Alternative("--disk-dir DIR", tiered_plan, least_needs(tiered_plan.candidates, tiered_limits),
                         tiered_limits)
    assert f"--disk-dir DIR              {tiered.describe()}" in block[1]


#: Llama-3-70B's shapes: docs/lora.md's 4-bit example.
LLAMA3_70B = LLAMA3_8B.replace('"hidden_size": 4096', '"hidden_size": 8192').replace(
    '"intermediate_size": 14336', '"intermediate_size": 28672').replace(
    '"num_attention_heads": 32, "num_hidden_layers": 32', '"num_attention_heads": 64, "num_hidden_layers": 80')


def test_the_four_bit_example_of_the_lora_doc_is_the_commands_output(capsys):
    text = (Path(__file__).resolve().parent.parent / "docs/lora.md").read_text()
    block = re.search(r"--gpu rtx-4090 --host-memory 59\.6\n```\n\n```\n(.*?)```", text, re.S)
    assert block, "the example's block moved: update this test"
    main(["plan", "--hf-config", LLAMA3_70B, "--lora-r", "16", "--quantize", "nf4", "--gpu", "rtx-4090",
          "--host-memory", "59.6"])
    assert capsys.readouterr().out == block[1]


def test_rates_without_the_disks_leave_the_disk_tier_out_of_what_would_fit(inputs, capsys):
    # Nothing fits the host; the disk tier cannot be timed without disk rates, so it is not tried.
    args = (*MLP, "--rates", "rates_no_disk.json", "--resident-slices", "0", "--host-memory", "0.05")
    found = {a["flags"]: a for a in _plan_json(capsys, *args)["alternatives"]}
    assert found and "--disk-dir DIR" not in found


def test_when_only_the_pinned_memory_is_short_the_alternatives_say_so(capsys):
    args = ("--preset", "transformer", "--set", "n_layers=4", "d_model=256", "--gpu", "a100", "--host-memory", "8",
            "--pinned-memory", "0.001", "--resident-slices", "0", "--batch-size", "32")
    with pytest.raises(SystemExit):
        main(["plan", *args])
    out = capsys.readouterr().out
    assert "nothing fits: needs" in out and "of pinned host memory at the least" in out
    said = {line.split("  needs ")[0].strip(): "needs " + line.split("  needs ")[1]
            for line in out.splitlines() if "  needs " in line}
    short = {flags: text for flags, text in said.items() if text.endswith("does not fit")}
    assert "--batch-size 1" in short
    # The host has room for each: the figure is the pinned memory, the least a candidate pins.
    plan, _ = _needs(capsys, *args, "--batch-size", "1")
    pinned = min(c.memory.pinned_bytes for c in plan.candidates if set(c.over) == {"pinned"})
    assert short["--batch-size 1"] == (f"needs {gib(pinned)} of pinned host memory (the platform pins 0.00 GiB): "
                                       "does not fit")
    assert all("of pinned host memory" in text for text in short.values()), short


def test_when_the_disk_is_short_the_figure_is_the_least_a_tiered_configuration_needs(tmp_path, capsys):
    # The disk short, the host not: a configuration with slices resident on the device keeps their
    # state off the disk and needs less of it than the one that needs the least host memory.
    args = ["--preset", "transformer", "--set", "n_layers=8", "d_model=2048", "--gpu", "rtx-4090", "--device-memory",
            "2", "--host-memory", "4", "--disk-dir", str(tmp_path), "--disk", "1"]
    parsed = parse_args(args)
    planner = Planner(machine_rates(parsed))
    limits = machine_limits(parsed, planner.rates)
    plan = planner.plan(parsed, limits)
    needs = least_needs(plan.candidates, limits)
    roomy = planner.plan(parsed, replace(limits, disk=100 * GIB))  # the profiles reused
    least = min(c.memory.disk for c in roomy.candidates if c.fits and c.config.optimizer_state == "disk")
    assert plan.chosen is None and needs.tiered_disk == least
    with pytest.raises(SystemExit):
        main(["plan", *args])
    out = capsys.readouterr().out
    assert f"of host memory and {gib(least)} of disk (has 4.00 GiB of host memory and 1.00 GiB of disk)" in out.splitlines()[4]
    disk = gib(least).removesuffix(" GiB")
    assert f"  --disk {disk}  " in out and out.split(f"  --disk {disk}  ")[1].split("\n")[0].endswith(": fits")


def test_when_device_and_host_are_short_the_device_memory_is_tried_and_says_the_host_it_then_needs(capsys):
    args = ("--preset", "transformer", "--set", "n_layers=2", "d_model=128", "--gpu", "h100-sxm",
            "--device-memory", "0.01", "--host-memory", "0.001")
    _, needs = _needs(capsys, *args)
    assert needs.host_memory is None and needs.tiered_host_memory is None  # nothing fits the device
    with pytest.raises(SystemExit):
        main(["plan", *args])
    out = capsys.readouterr().out
    device = gib(needs.device_memory).removesuffix(" GiB")
    _, again = _needs(capsys, *args[:-4], "--device-memory", device, "--host-memory", "0.001")
    assert (f"  --device-memory {device}  needs {gib(needs.device_memory)} of device memory and "
            f"{gib(again.host_memory)} of host memory: does not fit") in out
