"""``offload-finetune``'s options that only shape another one (the adapters' shape under ``--lora-r``, the
4-bit format under ``--load-in-4bit``) are parser errors without it, where they would change nothing,
silently; and a block too short to score a token is refused."""

import pytest

pytest.importorskip("transformers")

from offload.cli.finetune_args import parse_args  # noqa: E402


@pytest.mark.parametrize(("flags", "message"), [
    (["--bnb-4bit-quant-type", "fp4"], "--bnb-4bit-quant-type shapes --load-in-4bit's 4-bit base, which is off: add "
                                       "--load-in-4bit, or leave out --bnb-4bit-quant-type"),
    (["--lora-r", "4", "--no-bnb-4bit-use-double-quant"], "--no-bnb-4bit-use-double-quant shapes --load-in-4bit's"),
    (["--bnb-4bit-use-double-quant"], "--bnb-4bit-use-double-quant shapes --load-in-4bit's"),
    (["--lora-alpha", "16"], "--lora-alpha shapes --lora-r's adapters, which is off: add --lora-r R, or leave out "
                             "--lora-alpha"),
    (["--lora-dropout", "0.1"], "--lora-dropout shapes --lora-r's adapters"),
    (["--lora-r", "0", "--lora-targets", "q_proj"], "--lora-targets shapes --lora-r's adapters"),
    (["--seq-len", "1"], "--seq-len must be at least 2: a block's loss scores each token against the next"),
])
def test_an_option_without_the_one_it_shapes_is_a_parser_error(flags, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--out", str(tmp_path), "--device", "cpu", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_shaping_options_take_their_defaults_and_their_values_with_what_they_shape(tmp_path):
    plain = parse_args(["--out", str(tmp_path), "--device", "cpu"])
    assert (plain.lora_alpha, plain.lora_dropout, plain.lora_targets) == (None, 0.0, ["all-linear"])
    assert (plain.bnb_4bit_quant_type, plain.bnb_4bit_use_double_quant) == ("nf4", True)
    shaped = parse_args(["--out", str(tmp_path), "--device", "cpu", "--lora-r", "4", "--lora-alpha", "8",
                         "--lora-dropout", "0.1", "--lora-targets", "q_proj", "v_proj", "--load-in-4bit",
                         "--bnb-4bit-quant-type", "fp4", "--no-bnb-4bit-use-double-quant"])
    assert (shaped.lora_alpha, shaped.lora_dropout, shaped.lora_targets) == (8.0, 0.1, ["q_proj", "v_proj"])
    assert (shaped.bnb_4bit_quant_type, shaped.bnb_4bit_use_double_quant) == ("fp4", False)
