"""``offload-finetune`` where it fails: what it says, and that what it says works.

A run stopped after its last checkpoint (an export that failed, Ctrl-C or an error in the final
evaluation) resumes with the command it printed and exports the weights an uninterrupted run
does, bit for bit (Note: [Never lose a run], rule 4, in ``offload/cli/finetune.py``). Options the
run cannot use (a learning rate of ``nan``, ``--keep-checkpoints`` with nothing to keep) are parser
errors; text that is not UTF-8 is refused by file, offset and line before the model is built; a
checkpoint saved with another ``--seq-len`` is refused naming ``--seq-len``.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import shlex
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from offload.cli import finetune as cli  # noqa: E402
from offload.cli.finetune_args import parse_args  # noqa: E402
from offload.cli.models import byte_tokenizer  # noqa: E402
from offload.cli.outputs import EXPORT_RECORD  # noqa: E402
from offload.integrations import data  # noqa: E402
from offload.integrations.data import DataFormatError, check_encoding, token_blocks  # noqa: E402
from .helpers import cli_result  # noqa: E402

# Three steps, the last one checkpointed, and an eval split: the final evaluation runs after the
# last checkpoint, as the export does.
FLAGS = ["--device", "cpu", "--no-progress", "--batch-size", "2", "--seq-len", "16", "--num-slices", "3",
         "--steps", "3", "--save-every", "3", "--eval-fraction", "0.1"]


def run_cli(*args: str, capsys) -> tuple[int, str, str]:
    return cli_result(cli.main, args, capsys)


def weights_of(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: tensor for shard in sorted(out.glob("model*.safetensors")) for name, tensor in load_file(shard).items()}


def eval_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("eval step")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The weights and the evaluation lines of the run that never stopped."""
    out = tmp_path_factory.mktemp("whole") / "out"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli.main([*FLAGS, "--out", str(out)])
    return weights_of(out), eval_lines(printed.getvalue())


def export_fails(monkeypatch):
    def full_disk(args, *rest):
        (args.out / "model.safetensors").write_bytes(b"half a shard")  # the disk filled up while writing
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cli, "save_output", full_disk)
    return OSError, "saving to {out} failed (OSError)"


def interrupted_in_the_final_evaluation(monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "evaluate", interrupted)
    return SystemExit, "interrupted"


def final_evaluation_fails(monkeypatch):
    def fails(*args):
        raise RuntimeError("out of memory in the evaluation")

    monkeypatch.setattr(cli, "evaluate", fails)
    return RuntimeError, "stopped by RuntimeError"


@pytest.mark.parametrize("failure", [export_fails, interrupted_in_the_final_evaluation, final_evaluation_fails])
def test_a_run_stopped_after_its_last_checkpoint_finishes_with_the_command_it_printed(failure, uninterrupted, tmp_path,
                                                                                     capsys, monkeypatch):
    """The printed command, run as printed, trains nothing, evaluates, and exports the uninterrupted
    run's weights bit for bit, over whatever the stopped export left; run again, it is refused: the
    model in --out is finished now."""
    whole, whole_evals = uninterrupted
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["offload-finetune"])  # the program the printed command names
    with monkeypatch.context() as failing:
        raised, why = failure(failing)
        with pytest.raises(raised):
            cli.main([*FLAGS, "--out", str(out)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    checkpoint = out / "checkpoints" / "step-3"
    prefix = f"{why.format(out=out)} after step 3; last checkpoint: {checkpoint}; resume with: "
    assert last.startswith(prefix), last
    program, *argv = shlex.split(last.removeprefix(prefix))
    assert program == "offload-finetune" and argv == [*FLAGS, "--out", str(out), "--resume", str(checkpoint)]

    code, printed, err = run_cli(*argv, capsys=capsys)
    assert code == 0, err[-3000:]
    assert (f"nothing left to train (--steps 3); running what the stopped run had left: the final evaluation and the "
            f"export into {out}") in printed
    assert "step 1/" not in printed and eval_lines(printed) == whole_evals
    assert printed.strip().splitlines()[-1] == f"nothing left to train after step 3; saved to {out}"
    resumed = weights_of(out)
    assert resumed.keys() == whole.keys() and len(whole) > 3
    for name, tensor in whole.items():
        assert torch.equal(tensor, resumed[name]), name
    assert json.loads((out / EXPORT_RECORD).read_text()) == {"step": 3, "finished": True}

    code, printed, err = run_cli(*argv, capsys=capsys)
    assert code == 2 and printed == "" and f"--out {out} holds a finished model" in err, err


# -- the options ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "value", "message"), [
    *[("--lr", value, f"--lr must be a finite number above 0 (1e-5 to 1e-3 is usual), got {float(value)}")
      for value in ("-1", "0", "nan", "inf")],
    *[("--max-grad-norm", value, f"--max-grad-norm must be a finite number above 0 (leave it out for no clipping), "
                                 f"got {float(value)}") for value in ("-1", "0", "nan", "inf")],
    *[("--eval-fraction", value, f"--eval-fraction must be in [0, 1), got {float(value)}")
      for value in ("-0.1", "1", "nan", "inf")],
    *[("--lora-alpha", value, f"--lora-alpha must be a finite number above 0 (leave it out for twice the rank), "
                              f"got {float(value)}") for value in ("-16", "0", "nan", "inf")],
    *[("--lora-dropout", value, f"--lora-dropout must be in [0, 1), got {float(value)}")
      for value in ("-0.1", "1", "nan")],
])
def test_float_options_out_of_range_are_parser_errors(flag, value, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--out", str(tmp_path), "--device", "cpu", "--lora-r", "4", flag, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"offload-finetune: error: {message}"


def test_float_options_in_range_parse(tmp_path):
    args = parse_args(["--out", str(tmp_path), "--device", "cpu", "--lr", "1e-5", "--max-grad-norm", "0.5",
                       "--eval-fraction", "0", "--lora-r", "4", "--lora-alpha", "0.5", "--lora-dropout", "0"])
    assert (args.lr, args.max_grad_norm, args.eval_fraction, args.lora_alpha) == (1e-5, 0.5, 0.0, 0.5)


def test_a_finished_model_of_an_earlier_step_does_not_refuse_a_later_checkpoints_resume(tmp_path):
    # An earlier run's finished model in --out (another step) is what the run that saved the
    # checkpoint was going to overwrite: its printed resume command exports over it.
    from offload.cli.finetune_args import no_steps_left
    from offload.cli.outputs import mark_export

    out = tmp_path / "out"
    out.mkdir()
    assert no_steps_left(6, 6, out) is None  # nothing there
    (out / "model.safetensors").write_bytes(b"")
    assert "holds a finished model" in no_steps_left(6, 6, out)  # weights without a record
    mark_export(out, 3, finished=True)
    assert no_steps_left(6, 6, out) is None  # an earlier run's model, of step 3
    mark_export(out, 6, finished=False)
    assert no_steps_left(6, 6, out) is None  # this run's export, stopped half way
    mark_export(out, 6, finished=True)
    assert "holds a finished model" in no_steps_left(6, 6, out)  # this run's, finished
    assert "holds a finished model" in no_steps_left(2, 2, out)  # an older checkpoint resumed by mistake
    assert "nothing would train" in no_steps_left(7, 6, out)


def test_resume_latest_under_a_file_is_a_parser_error(tmp_path, capsys):
    (tmp_path / "out").write_text("not a directory")
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path / "out"), "--resume", "latest"])
    assert "offload-finetune: error: --resume latest:" in capsys.readouterr().err


def test_keep_checkpoints_without_save_every_is_a_parser_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--out", str(tmp_path), "--device", "cpu", "--keep-checkpoints", "2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "offload-finetune: error: --keep-checkpoints keeps the newest of the checkpoints --save-every N saves, and "
        "none is saved without it: add --save-every N, or leave out --keep-checkpoints")
    assert parse_args(["--out", str(tmp_path), "--device", "cpu", "--keep-checkpoints", "2", "--save-every", "5"])


# -- data that is not UTF-8 -------------------------------------------------------------------------------


def with_a_latin1_byte(path: Path, lines: int) -> int:
    """Write ``lines`` lines of UTF-8 (two-byte characters among them), then one with a Latin-1
    é; the é's offset."""
    good = "".join(f"{n}: héllo wörld, ñ and ß\n" for n in range(lines)).encode("utf-8")
    path.write_bytes(good + "caf\xe9 au lait\n".encode("latin-1"))
    return len(good) + 3


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_a_byte_that_is_not_utf8_is_named_by_offset_and_line(suffix, tmp_path, monkeypatch):
    """Read in chunks of 28 bytes, so that two-byte characters straddle the chunks' ends."""
    monkeypatch.setattr(data, "TEXT_CHUNK_BYTES", 7)
    path = tmp_path / f"corpus{suffix}"
    offset = with_a_latin1_byte(path, 500)
    expected = (f"{path}: not UTF-8 text: byte 0xe9 at offset {offset} (line 501) does not decode; re-encode the file "
                f"as UTF-8 (Latin-1 text, say: iconv -f LATIN1 -t UTF-8 {path} > corpus-utf8{suffix})")
    with pytest.raises(DataFormatError) as refused:
        check_encoding(path)
    assert str(refused.value) == expected
    path.write_bytes("ok: héllo\n".encode("utf-8") * 500)
    check_encoding(path)  # UTF-8 whatever the chunks cut
    path.write_bytes("ok: héllo\n".encode("utf-8") + "é".encode("utf-8")[:1])
    with pytest.raises(DataFormatError, match=r"byte 0xc3 at offset 11 \(line 2\)"):  # cut short at the end
        check_encoding(path)


def test_the_lazy_reader_names_the_byte_where_it_reaches_it(tmp_path):
    path = tmp_path / "corpus.txt"
    offset = with_a_latin1_byte(path, 20_000)  # past the first read
    blocks = token_blocks(path, byte_tokenizer(), 64)
    assert next(blocks).shape == (64,)
    with pytest.raises(DataFormatError, match=rf"{path}: not UTF-8 text: byte 0xe9 at offset {offset} \(line 20001\)"):
        list(blocks)


@pytest.mark.parametrize("flag", ["--data", "--eval-file"])
def test_text_that_is_not_utf8_is_refused_before_the_model_is_built(flag, tmp_path, capsys, monkeypatch):
    path = tmp_path / "latin1.txt"
    offset = with_a_latin1_byte(path, 2000)
    built = []
    monkeypatch.setattr(cli, "random_model", lambda *args: built.append(args))
    code, printed, err = run_cli("--device", "cpu", "--no-progress", "--out", str(tmp_path / "out"), flag, str(path),
                                 capsys=capsys)
    assert code == 1 and built == [] and printed == ""
    assert err.strip().startswith(f"offload-finetune: error: {path}: not UTF-8 text: byte 0xe9 at offset {offset} "
                                  "(line 2001) does not decode; re-encode the file as UTF-8"), err


# -- checkpoints of another model ---------------------------------------------------------------------------


@pytest.mark.parametrize(("saved", "resumed", "advice"), [(16, 128, "--seq-len 64 or less"), (96, 16, "--seq-len 96")])
def test_a_checkpoint_saved_with_another_seq_len_names_seq_len(saved, resumed, advice, tmp_path, capsys):
    """GPT-2's position table has max(--seq-len, 64) rows in a random model: the advice is the
    --seq-len of the run that saved it, not the options that are the same."""
    flags = ["--device", "cpu", "--no-progress", "--arch", "gpt2", "--batch-size", "2", "--out", str(tmp_path)]
    code, _, err = run_cli(*flags, "--steps", "1", "--save-every", "1", "--seq-len", str(saved), capsys=capsys)
    assert code == 0, err[-3000:]
    checkpoint = tmp_path / "checkpoints" / "step-1"
    code, _, err = run_cli(*flags, "--steps", "2", "--seq-len", str(resumed), "--resume", str(checkpoint),
                           capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and line.startswith(f"offload-finetune: error: --resume: checkpoint {checkpoint} holds another "
                                         "model: 0.wpe.weight is float32["), line
    assert line.endswith(f"; pass {advice}, as the run that saved it did (a random model's position table has "
                         "max(--seq-len, 64) rows), or leave out --resume to start over"), line


def test_a_checkpoint_of_another_model_names_the_options_that_shape_one(tmp_path, capsys):
    flags = ["--device", "cpu", "--no-progress", "--arch", "gpt2", "--batch-size", "2", "--seq-len", "16",
             "--out", str(tmp_path)]
    code, _, err = run_cli(*flags, "--steps", "1", "--save-every", "1", "--lora-r", "4", capsys=capsys)
    assert code == 0, err[-3000:]
    code, _, err = run_cli(*flags, "--steps", "2", "--lora-r", "8", "--resume", "latest", capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and "holds another model" in line, line
    assert line.endswith("; pass the options of the run that saved it (--model, or --arch and --size; --lora-r, "
                         "--lora-targets, --untie-embeddings; --compute-dtype, --load-in-4bit and the --bnb-4bit-* "
                         "options, which change how a quantized base is stored), or leave out --resume to start "
                         "over"), line


# -- checkpoints the slice-by-slice load cannot read ----------------------------------------------------------


def test_a_model_saved_quantized_is_a_parser_error(tmp_path, capsys):
    """``save_pretrained`` of a 4-bit model writes codes and their state; the unquantized
    checkpoint is what to give, with --load-in-4bit."""
    model = tmp_path / "q4"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")  # never read: the config refuses it first
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {
        "quant_method": "bitsandbytes", "load_in_4bit": True}}))
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--out", str(tmp_path / "out"), "--device", "cpu", "--model", str(model), "--lora-r", "4"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"offload-finetune: error: --model {model} holds a checkpoint saved quantized (bitsandbytes: its config.json "
        "has a quantization_config), which offload-finetune cannot train from: give --model the unquantized "
        "checkpoint it was made from, with --load-in-4bit to quantise its linear layers as they load")
    # --untie-embeddings loads the model with from_pretrained, which reads it: not refused here.
    args = parse_args(["--out", str(tmp_path / "out"), "--device", "cpu", "--model", str(model), "--lora-r", "4",
                       "--untie-embeddings"])
    assert args.model == model


def test_a_gpt2_model_under_load_in_4bit_is_refused_in_one_line(tmp_path, capsys):
    """GPT-2's projections are Conv1D, which the slice-by-slice load does not quantise: the
    library's refusal, as one line, as for the random GPT-2."""
    pytest.importorskip("bitsandbytes")
    model = tmp_path / "gpt2"
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=256, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    code, _, err = run_cli("--device", "cpu", "--no-progress", "--model", str(model), "--out", str(tmp_path / "out"),
                           "--steps", "1", "--lora-r", "2", "--load-in-4bit", capsys=capsys)
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("offload-finetune")]
    assert code == 1 and line.startswith(f"offload-finetune: error: --model {model}: GPT2LMHeadModel has no "
                                         "nn.Linear layer but its head to quantise in 4 bits"), err[-3000:]


# -- a finished model in --out (Note: [Never lose a run], rule 6) ---------------------------------------------

TINY = ["--device", "cpu", "--no-progress", "--batch-size", "2", "--seq-len", "16", "--steps", "1"]


def model_files(out: Path) -> list[str]:
    return sorted(path.name for path in out.iterdir() if path.is_file() and not path.name.startswith("tokenizer"))


def test_a_new_run_into_a_finished_model_is_refused_before_anything_is_built(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    code, _, err = run_cli(*TINY, "--out", str(out), capsys=capsys)
    assert code == 0, err[-3000:]
    finished = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    built = []
    monkeypatch.setattr(cli, "random_model", lambda *args: built.append(args))
    code, printed, err = run_cli(*TINY, "--seed", "5", "--out", str(out), capsys=capsys)
    assert code == 1 and built == [] and printed == ""
    assert err.strip() == (f"offload-finetune: error: --out {out} holds a finished model, which this run's export "
                           "would replace: choose another --out, or pass --overwrite to replace it")
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == finished


def test_overwrite_replaces_the_model_and_leaves_no_file_of_the_old_one(tmp_path, capsys):
    """Three shards replaced by two: the third goes, the index names what is there."""
    out = tmp_path / "out"
    code, _, err = run_cli(*TINY, "--num-slices", "3", "--out", str(out), capsys=capsys)
    assert code == 0 and "model-00003-of-00003.safetensors" in model_files(out), err[-3000:]
    (out / "notes.txt").write_text("mine")  # not a model's file: left
    code, _, err = run_cli(*TINY, "--num-slices", "2", "--out", str(out), "--overwrite", capsys=capsys)
    assert code == 0, err[-3000:]
    assert model_files(out) == ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                                "model-00002-of-00002.safetensors", "model.safetensors.index.json", "notes.txt",
                                EXPORT_RECORD]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert json.loads((out / EXPORT_RECORD).read_text()) == {"step": 1, "finished": True}


def test_an_adapter_replaces_a_full_model_and_a_full_model_an_adapter(tmp_path, capsys):
    """Not an adapter beside a full model's shards, which from_pretrained would read together."""
    pytest.importorskip("peft")
    base, out = tmp_path / "base", tmp_path / "out"
    for target in (base, out):
        code, _, err = run_cli(*TINY, "--out", str(target), capsys=capsys)
        assert code == 0, err[-3000:]
    code, _, err = run_cli(*TINY, "--model", str(base), "--lora-r", "2", "--out", str(out), "--overwrite",
                           capsys=capsys)
    assert code == 0, err[-3000:]
    assert [name for name in model_files(out) if name != "README.md"] == ["adapter_config.json",
                                                                          "adapter_model.safetensors", EXPORT_RECORD]
    code, _, err = run_cli(*TINY, "--out", str(out), "--overwrite", capsys=capsys)
    assert code == 0, err[-3000:]
    assert not any(name.startswith("adapter_") for name in model_files(out)) and (out / "config.json").is_file()


def test_out_that_is_model_is_refused_with_or_without_overwrite(tmp_path, capsys):
    model = tmp_path / "model"
    code, _, err = run_cli(*TINY, "--out", str(model), capsys=capsys)
    assert code == 0, err[-3000:]
    code, _, err = run_cli(*TINY, "--model", str(model), "--out", str(model), "--overwrite", capsys=capsys)
    assert code == 1 and err.strip() == (f"offload-finetune: error: --out {model} is --model, whose weights the export "
                                         "would remove (a LoRA adapter's base among them): choose another --out"), err


# -- parquet and CSV files their reader refuses ---------------------------------------------------------------


@pytest.mark.parametrize(("flag", "name", "content", "reason"), [
    ("--data", "fake.parquet", b"hello\n", "(ArrowInvalid: Parquet file size is 6 bytes"),
    ("--eval-file", "fake.parquet", b"PAR1 not a footer PAR1", "(ArrowInvalid: "),
    ("--data", "bad.csv", b'text,b\n"hello world,1\nfoo,2,3,4\n', "(ParserError: Error tokenizing data."),
])
def test_a_parquet_or_csv_file_its_reader_refuses_is_one_line_before_the_model_is_built(flag, name, content, reason,
                                                                                       tmp_path, capsys, monkeypatch):
    pytest.importorskip("datasets")
    path = tmp_path / name
    path.write_bytes(content)
    built = []
    monkeypatch.setattr(cli, "random_model", lambda *args: built.append(args))
    code, printed, err = run_cli(*TINY, "--out", str(tmp_path / "out"), flag, str(path), capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and built == [] and printed == "" and "Traceback" not in err
    what = "parquet" if name.endswith(".parquet") else "CSV"
    assert line.startswith(f"offload-finetune: error: {path}: not a {what} file its reader can read, at or before "
                           f"row 1 {reason}"), line
    assert line.endswith("; fix or re-export the file"), line
