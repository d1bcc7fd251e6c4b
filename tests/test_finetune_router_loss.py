"""``offload-finetune`` on a mixture of experts: its load-balancing loss is added as its config asks,
or as ``--router-aux-loss-coef`` says, and the weights trained equal the plain model's trained on the
same loss with PyTorch and transformers alone (Note: [A router loss in the command] in
``offload/cli/finetune_loss.py``)."""

from __future__ import annotations

import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from offload.cli import finetune as cli  # noqa: E402
from offload.cli.finetune_args import parse_args  # noqa: E402
from offload.cli.models import random_model  # noqa: E402
from offload.integrations.transformers import CausalLMSequential  # noqa: E402

from .test_finetune import EXACT, run_cli  # noqa: E402

#: A step of two batches of two 16-token blocks, a loss from logits or from the head's chunks.
FLAGS = ["--arch", "mixtral", "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--compute-dtype", "none", "--num-slices", "2",
         "--lr", "3e-3", "--grad-accum", "2"]


def reference_run(args: list[str], model: torch.nn.Module, tokenizer,
                  coefficient: float | None) -> torch.nn.Module:
    """``model`` trained as the command trains it, with torch's AdamW: each batch's loss is its share
    of the step's mean cross-entropy plus ``coefficient`` times its aux loss over the step's batches."""
    namespace = parse_args([*args, "--device", "cpu"])
    model.config.use_cache = False
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)
    batches = cli.Batches(namespace, tokenizer).train()
    for _ in range(namespace.steps):
        micro = [next(batches) for _ in range(2)]
        tokens = sum(ids[:, 1:].numel() for ids in micro)
        for ids in micro:
            output = model(input_ids=ids, output_router_logits=coefficient is not None)
            loss = model.loss_function(logits=output.logits, labels=ids, vocab_size=256, num_items_in_batch=tokens)
            if coefficient is not None:
                loss = loss + coefficient * output.aux_loss / 2
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def trained(path) -> dict[str, torch.Tensor]:
    return transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.parametrize("chunks", ["0", "1024"], ids=["logits", "loss-in-head"])
def test_the_coefficient_given_trains_the_plain_models_weights_with_its_router_loss(chunks, tmp_path, capsys):
    args = ["--out", str(tmp_path / "out"), *FLAGS, "--loss-chunk-tokens", chunks, "--router-aux-loss-coef", "0.5"]
    code, out, err = run_cli(*args, tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    assert "load-balancing loss x 0.5;" in out
    torch.manual_seed(0)
    with_loss = reference_run(args, *random_model("mixtral", "tiny", 256, 16), coefficient=0.5)
    torch.testing.assert_close(trained(tmp_path / "out"), with_loss.state_dict(), **EXACT)
    torch.manual_seed(0)
    without = reference_run(args, *random_model("mixtral", "tiny", 256, 16), coefficient=None)
    assert not torch.equal(without.model.layers[0].mlp.gate.weight, with_loss.model.layers[0].mlp.gate.weight)


def saved_mixtral(folder, output_router_logits: bool) -> None:
    torch.manual_seed(1)
    model, tokenizer = random_model("mixtral", "tiny", 256, 16)
    model.config.output_router_logits = output_router_logits
    model.config.router_aux_loss_coef = 0.25
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.parametrize("given", [None, "0"], ids=["config", "turned-off"])
def test_a_saved_model_whose_config_asks_adds_its_loss_unless_turned_off(given, tmp_path, capsys):
    """A model saved with ``output_router_logits`` (loaded slice by slice) trains with its config's
    coefficient, where it was refused; ``--router-aux-loss-coef 0`` leaves the loss out."""
    saved_mixtral(tmp_path / "base", output_router_logits=True)
    args = ["--model", str(tmp_path / "base"), "--out", str(tmp_path / "out"), *FLAGS, "--loss-chunk-tokens", "0"]
    args += [] if given is None else ["--router-aux-loss-coef", given]
    code, out, err = run_cli(*args, tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    assert ("load-balancing loss x 0.25;" in out) == (given is None), out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "base")
    want = reference_run(args, model, tokenizer, coefficient=0.25 if given is None else None)
    torch.testing.assert_close(trained(tmp_path / "out"), want.state_dict(), **EXACT)


def test_the_evaluation_reports_the_cross_entropy_alone(tmp_path, capsys):
    """The eval loss is the one its perplexity is of: without the load-balancing term."""
    args = ["--out", str(tmp_path / "out"), *FLAGS, "--steps", "1", "--loss-chunk-tokens", "0",
            "--router-aux-loss-coef", "5", "--eval-fraction", "0.3", "--eval-batches", "2"]
    code, out, err = run_cli(*args, tmp_path=tmp_path, capsys=capsys)
    assert code == 0, err
    reported = float(re.search(r"eval step 1/1  loss (\S+)", out)[1])
    namespace = parse_args([*args, "--device", "cpu"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    batches = cli.Batches(namespace, transformers.AutoTokenizer.from_pretrained(tmp_path / "out")).evaluation()
    tokens = sum(CausalLMSequential.count_loss_tokens(ids) for ids in batches)
    with torch.no_grad():
        want = sum(model.loss_function(logits=model(input_ids=ids).logits, labels=ids, vocab_size=256,
                                       num_items_in_batch=tokens).item() for ids in batches)
    assert math.isclose(reported, want, abs_tol=1e-4), (reported, want)


def test_a_coefficient_for_a_model_without_a_router_loss_is_one_line(tmp_path, capsys):
    code, out, err = run_cli("--out", str(tmp_path / "out"), "--arch", "llama", "--steps", "1",
                             "--router-aux-loss-coef", "0.01", tmp_path=tmp_path, capsys=capsys)
    assert code == 1
    assert "--router-aux-loss-coef: LlamaForCausalLM adds no load-balancing loss" in err and "leave it out" in err
    assert "Traceback" not in err and not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-0.1"])
def test_a_coefficient_out_of_range_is_a_parser_error(value, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(["--out", "x", "--arch", "mixtral", f"--router-aux-loss-coef={value}"])
    assert stop.value.code == 2
    assert "--router-aux-loss-coef must be a finite number, 0 or more" in capsys.readouterr().err


def test_the_plan_of_a_config_asking_for_router_logits_prints_stages_that_carry_them(tmp_path, capsys):
    """``offload plan --hf-config`` cuts such a model as the command trains it (where it was refused),
    and the Python it prints builds stages that carry the router logits."""
    from offload.cli.main import main

    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        num_local_experts=4, output_router_logits=True)
    (tmp_path / "config.json").write_text(config.to_json_string())
    main(["plan", "--hf-config", str(tmp_path / "config.json"), "--gpu", "a100", "--seq-len", "32"])
    printed = capsys.readouterr().out
    assert "causal_lm_sequential(hf_model, loss_chunk_tokens=1024, router_logits=True)" in printed, printed
