"""A model folder's ``generation_config.json`` through ``load_causal_lm``, ``OffloadedCausalLM`` and the
fine-tune command, against the plain model: read as ``from_pretrained`` reads it, written back unchanged
by every save, and an assigned ``generation_config`` (or ``config``) is the one saved (Note: [The
model's configs, not copies] in ``offload/integrations/causal_lm_configs.py``). Tiny random models
saved here; nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GenerationConfig  # noqa: E402

from offload.integrations.causal_lm import OffloadedCausalLM  # noqa: E402
from offload.integrations.transformers import load_causal_lm  # noqa: E402

from .helpers import quiet_transformers  # noqa: E402,F401 (autouse)
from .test_transformers import build  # noqa: E402

#: An instruct model's generation settings: two end tokens, sampling defaults and a length, none of
#: which ``config.json`` holds.
INSTRUCT = {"bos_token_id": 0, "eos_token_id": [0, 7], "pad_token_id": 0, "do_sample": True, "temperature": 0.6,
            "top_p": 0.9, "max_new_tokens": 6}


def saved_model(kind: str, folder: Path, generation: dict | None = INSTRUCT) -> Path:
    """A tiny model of ``kind`` saved in ``folder``, with ``generation`` as its generation config
    (``None``: no ``generation_config.json`` at all)."""
    model = build(kind, dropout=0.0)
    if generation is not None:
        model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(folder)
    if generation is None:
        (folder / "generation_config.json").unlink()
    return folder


def plain(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def file_of(folder: Path) -> dict:
    return json.loads((folder / "generation_config.json").read_text())


@pytest.mark.parametrize("generation", [INSTRUCT, None], ids=["with-file", "without-file"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_loading_reads_the_generation_config_as_from_pretrained(kind, generation, tmp_path):
    """The folder's file, or without one the config read from ``config.json``: ``to_dict()`` equal to
    the plain model's, on ``load_causal_lm``'s model and on ``OffloadedCausalLM.from_pretrained``'s,
    and the same tokens sampled from the same seed."""
    folder = saved_model(kind, tmp_path / "model", generation)
    reference = plain(folder)
    want = reference.generation_config.to_dict()
    _, hf = load_causal_lm(folder, "cpu", num_slices=2)
    assert hf.generation_config.to_dict() == want
    model = OffloadedCausalLM.from_pretrained(folder, "cpu", num_slices=2)
    assert model.generation_config.to_dict() == want
    assert model.generation_config is model.hf_model.generation_config
    if generation is not None:
        assert model.generation_config.eos_token_id == [0, 7] and model.generation_config.temperature == 0.6
    prompt = torch.tensor([[5, 9, 11, 3]])
    length = {} if generation is not None else {"max_new_tokens": 6}  # the file's, where there is one
    torch.manual_seed(0)
    expected = reference.generate(prompt, **length)
    torch.manual_seed(0)
    assert torch.equal(model.hf_model.generate(prompt, **length), expected)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_save_writes_the_loaded_generation_config_back_unchanged(kind, tmp_path):
    """``save_pretrained`` into another folder writes the file the plain model's save writes; saving
    back into the folder the model was loaded from (as the Trainer does into its output) keeps it."""
    folder = saved_model(kind, tmp_path / "model")
    original = file_of(folder)
    plain(folder).save_pretrained(tmp_path / "plain")
    model = OffloadedCausalLM.from_pretrained(folder, "cpu", num_slices=2)
    model.save_pretrained(tmp_path / "out")
    assert file_of(tmp_path / "out") == file_of(tmp_path / "plain") == original
    model.save_pretrained(folder)
    assert file_of(folder) == original
    assert transformers.AutoModelForCausalLM.from_pretrained(folder).generation_config.to_dict() == \
        plain(tmp_path / "plain").generation_config.to_dict()


def test_an_assigned_generation_config_is_the_model_s_and_is_saved(tmp_path):
    """``model.generation_config = GenerationConfig(...)``, the transformers idiom, on the wrapper as
    on the plain model: it is the Hugging Face model's, and the save writes what the plain one's does."""
    hf = build("llama", dropout=0.0)
    reference = copy.deepcopy(hf)
    model = OffloadedCausalLM(hf, "cpu", num_slices=2)
    assigned = GenerationConfig(**INSTRUCT)
    model.generation_config = assigned
    reference.generation_config = GenerationConfig(**INSTRUCT)
    assert model.generation_config is assigned and hf.generation_config is assigned
    model.save_pretrained(tmp_path / "out")
    reference.save_pretrained(tmp_path / "plain")
    assert file_of(tmp_path / "out") == file_of(tmp_path / "plain")
    assert file_of(tmp_path / "out")["eos_token_id"] == [0, 7]


def test_an_assigned_config_is_the_model_s_and_is_saved(tmp_path):
    """``model.config = ...`` replaces the Hugging Face model's, which the forward reads and the save
    writes, as on the plain model (its layers keep the object they were built with, there too)."""
    hf = build("llama", dropout=0.0)
    model = OffloadedCausalLM(hf, "cpu", num_slices=2)
    assert model.config is hf.config
    assigned = copy.deepcopy(hf.config)
    assigned.pad_token_id = 5
    model.config = assigned
    assert model.config is assigned and hf.config is assigned
    model.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["pad_token_id"] == 5


@pytest.mark.parametrize("untie", [False, True], ids=["slice-by-slice", "untie-embeddings"])
def test_the_fine_tune_command_keeps_the_models_generation_config(untie, tmp_path, capsys):
    """Both of the command's load paths, ``load_causal_lm`` and ``from_pretrained`` (for
    ``--untie-embeddings``), export the base model's generation config with the fine-tuned weights."""
    from offload.cli import finetune as cli
    from offload.cli.models import random_model

    from .helpers import cli_result

    torch.manual_seed(0)
    base, tokenizer = random_model("llama", "tiny", 256, 16)
    base.generation_config = GenerationConfig(**{**INSTRUCT, "eos_token_id": [0, 10], "max_new_tokens": 64})
    base.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    original = file_of(tmp_path / "base")
    code, _, err = cli_result(cli.main, ["--device", "cpu", "--no-progress", "--model", str(tmp_path / "base"),
                                         "--out", str(tmp_path / "out"), "--steps", "1", "--batch-size", "1",
                                         "--seq-len", "16", "--num-slices", "3",
                                         *(["--untie-embeddings"] if untie else [])], capsys)
    assert code == 0, err[-3000:]
    assert file_of(tmp_path / "out") == original
