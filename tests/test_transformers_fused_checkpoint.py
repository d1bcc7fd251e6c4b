"""A checkpoint that stores tensors the model splits on loading (Sarvam-MoE's fused ``query_key_value``,
which transformers splits into ``q_proj``, ``k_proj`` and ``v_proj``): the loader does not split
them, so each way in says so and what to do instead, in its own words, and ``offload plan`` prints
no ``offload-finetune`` command for such a model (docs/huggingface.md)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from offload.cli.main import main

transformers = pytest.importorskip("transformers", reason='transformers is not installed: pip install -e ".[transformers]"')
from offload.integrations.transformers import OffloadedCausalLM, load_causal_lm  # noqa: E402

from .test_transformers import build  # noqa: E402

if "sarvam_moe" not in transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES:
    pytest.skip(f"transformers {transformers.__version__} has no sarvam_moe", allow_module_level=True)

FUSED = r"'model\.layers\.\d\.attention\.query_key_value\.weight' is stored in a form the model converts on loading"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("sarvam_moe")
    hf = build("sarvam_moe", dropout=0.0, layers=2)
    hf.save_pretrained(path)
    return hf, path


def test_load_causal_lm_and_from_pretrained_refuse_it_naming_the_way_that_loads_it(saved):
    _, path = saved
    advice = FUSED + r".*from_pretrained and wrap that model with OffloadedCausalLM\(hf_model, \.\.\.\)"
    with pytest.raises(ValueError, match=advice):
        load_causal_lm(path, "cpu")
    with pytest.raises(ValueError, match=advice):
        OffloadedCausalLM.from_pretrained(path, "cpu")
    # What it advises loads it, equal to the model saved.
    reference = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert all(t.equal(saved[0].state_dict()[name]) for name, t in reference.state_dict().items())


def test_load_state_dict_refuses_it_in_words_of_its_own(saved):
    hf, path = saved
    model = OffloadedCausalLM(build("sarvam_moe", dropout=0.0, layers=2), device="cpu", num_slices=1)
    with pytest.raises(RuntimeError, match=FUSED + r".*which load_state_dict does not convert") as refused:
        model.load_state_dict(load_file(path / "model.safetensors"))
    assert "load_causal_lm" not in str(refused.value)


@pytest.mark.parametrize("model_type,printed", [("sarvam_moe", False), ("glm4_moe", True)])
def test_plan_prints_no_finetune_command_for_a_model_whose_checkpoints_it_refuses(model_type, printed, tmp_path,
                                                                                    capsys):
    build(model_type, dropout=0.0, layers=2).config.save_pretrained(tmp_path)
    main(["plan", "--hf-config", str(tmp_path), "--gpu", "a100", "--host-memory", "8", "--seq-len", "32",
          "--batch-size", "2", "--json"])
    assert (json.loads(capsys.readouterr().out)["chosen"]["finetune"] is not None) == printed
