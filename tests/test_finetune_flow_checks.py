"""``offload-finetune``'s flow around its data: what is refused before the model is built, before
the first step and at a resume, and how a run that the data stops partway through ends.

Data errors that need no model (a wrong ``--text-field``, an empty file, chat records for a tokenizer
without a chat template, a directory that is not a ``datasets`` save) are refused before the model
is built, from the first document of ``--data`` and ``--eval-file``; a tokenizer with more ids than
the model has embeddings before the first step; a resume with other training-stream options than the
run that saved the checkpoint after its load (Note: [Never lose a run], rule 3, in
``offload/cli/finetune.py``), while one with other evaluation options goes on with a note.
The reader's error partway through training ends the run with the stop line and the error, no
traceback, and the advice to mend the data before the printed resume (rule 2).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from offload.cli import finetune as cli  # noqa: E402
from offload.cli.models import random_model  # noqa: E402
from offload.integrations import data  # noqa: E402
from offload.integrations.data import DataFormatError  # noqa: E402
from .helpers import cli_result  # noqa: E402

TINY = ["--device", "cpu", "--no-progress", "--batch-size", "2", "--seq-len", "16", "--num-slices", "2"]
SAMPLE = Path(cli.__file__).resolve().parent / "sample.txt"


def run_cli(*args: str, capsys) -> tuple[int, str, str]:
    return cli_result(cli.main, [*TINY, *args], capsys)


def watch_builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The random models the run builds (none, for a run refused before the model)."""
    built: list[tuple] = []
    monkeypatch.setattr(cli, "random_model", lambda *args: built.append(args))
    return built


# -- refused before the model is built --------------------------------------------------------------------------


def jsonl(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def wrong_text_field(tmp_path: Path) -> tuple[list[str], str]:
    path = jsonl(tmp_path / "body.jsonl", {"body": "hello there"})
    return ["--data", str(path), "--text-field", "bdy"], f"{path}, record 1: has no field 'bdy'"


def eval_file_without_text(tmp_path: Path) -> tuple[list[str], str]:
    path = jsonl(tmp_path / "body.jsonl", {"body": "hello there"})
    return ["--eval-file", str(path)], f"{path}, record 1: has no 'text' field nor chat 'messages'"


def empty_data(tmp_path: Path) -> tuple[list[str], str]:
    path = tmp_path / "empty.txt"
    path.write_text("")
    return ["--data", str(path)], (f"--data {path} holds no text (an empty file, or one without a record); give the "
                                   "text to train on")


def empty_eval_file(tmp_path: Path) -> tuple[list[str], str]:
    path = tmp_path / "blank.jsonl"
    path.write_text("\n\n")
    return ["--eval-file", str(path)], (f"--eval-file {path} holds no text (an empty file, or one without a record); "
                                        "give the text to evaluate on")


def chats_for_the_byte_tokenizer(tmp_path: Path) -> tuple[list[str], str]:
    path = jsonl(tmp_path / "chats.jsonl", {"messages": [{"role": "user", "content": "hi"}]})
    return ["--data", str(path)], f"{path}, record 1: chat messages, but the tokenizer has no chat template"


def directory_not_saved_by_datasets(tmp_path: Path) -> tuple[list[str], str]:
    pytest.importorskip("datasets")
    folder = tmp_path / "plain"
    folder.mkdir()
    jsonl(folder / "a.jsonl", {"text": "hello there"})
    return ["--data", str(folder)], f"{folder}: a directory, but not one written by datasets' save_to_disk"


@pytest.mark.parametrize("case", [wrong_text_field, eval_file_without_text, empty_data, empty_eval_file,
                                  chats_for_the_byte_tokenizer, directory_not_saved_by_datasets])
def test_data_errors_that_need_no_model_are_refused_before_it_is_built(case, tmp_path, capsys, monkeypatch):
    flags, message = case(tmp_path)
    built = watch_builds(monkeypatch)
    code, printed, err = run_cli("--out", str(tmp_path / "out"), "--steps", "1", *flags, capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and built == [] and printed == "", err
    assert line.startswith(f"offload-finetune: error: {message}"), line


def test_the_first_documents_pass_and_the_run_trains(tmp_path, capsys):
    """What the check reads is what training reads: JSON lines with their field named, to train on
    and to evaluate on."""
    lines = SAMPLE.read_text().splitlines()
    records = jsonl(tmp_path / "notes.jsonl", *({"body": line} for line in lines[:24]))
    held_out = jsonl(tmp_path / "held_out.jsonl", *({"body": line} for line in lines[24:]))
    code, printed, err = run_cli("--out", str(tmp_path / "out"), "--steps", "1", "--data", str(records),
                                 "--text-field", "body", "--eval-file", str(held_out), capsys=capsys)
    assert code == 0 and "eval step 1/1" in printed, err[-3000:]


# -- the tokenizer and the model's embeddings -------------------------------------------------------------------


def saved_model(folder: Path, vocab: int) -> Path:
    """A tiny random Llama of ``vocab`` embedding rows, saved with the byte tokenizer (256 ids)."""
    hf, tokenizer = random_model("llama", "tiny", vocab, 16)
    hf.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_tokenizer_with_more_ids_than_the_model_has_embeddings_is_refused_before_the_first_step(tmp_path, capsys):
    model = saved_model(tmp_path / "model", 200)
    code, printed, err = run_cli("--model", str(model), "--out", str(tmp_path / "out"), "--steps", "1", capsys=capsys)
    (line,) = err.strip().splitlines()
    assert code == 1 and "step 1/" not in printed and "Traceback" not in err, err[-3000:]
    assert line == (f"offload-finetune: error: --model {model}: its tokenizer has 256 ids and the model's input "
                    "embeddings 200 rows, so ids 200 and up have none: save the model with the tokenizer it was "
                    "trained with, or grow its embeddings to the tokenizer (model.resize_token_embeddings(256), then "
                    "save_pretrained) and pass that"), line
    assert not any((tmp_path / "out").glob("*.safetensors"))


def test_a_tokenizer_with_fewer_ids_than_the_model_has_embeddings_trains(tmp_path, capsys):
    """A vocabulary padded past the tokenizer's ids (to a multiple of 64, say) is usual."""
    model = saved_model(tmp_path / "model", 320)
    code, printed, err = run_cli("--model", str(model), "--out", str(tmp_path / "out"), "--steps", "1", capsys=capsys)
    assert code == 0 and "step 1/1" in printed, err[-3000:]


# -- data damaged partway through -------------------------------------------------------------------------------


def damaged_after(monkeypatch: pytest.MonkeyPatch, blocks: int) -> str:
    """The reader refuses what follows the first ``blocks`` blocks of a pass, as it refuses a
    damaged record deep in a file (whatever it finds before the model is built); its message."""
    real = data.token_blocks
    message = "corpus.jsonl, line 9: not a JSON object (Expecting value); JSON lines hold one object a line"

    def damaged(*args, **kwargs):
        for count, block in enumerate(real(*args, **kwargs)):
            if count == blocks:
                raise DataFormatError(message)
            yield block

    monkeypatch.setattr(data, "token_blocks", damaged)
    return message


# Two blocks a step, in the file's order: the damage after four blocks stops the third step.
STOPPED = ["--steps", "4", "--shuffle-buffer", "1"]


def test_data_damaged_partway_through_ends_in_two_lines_and_the_mended_data_resumes(tmp_path, capsys, monkeypatch):
    """The stop line names the last checkpoint, then the reader's error with the advice to mend the
    data first (the printed resume alone would stop at the same record), no traceback; once mended,
    the printed command resumes and finishes."""
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["offload-finetune"])  # the program the printed command names
    with monkeypatch.context() as damaging:
        message = damaged_after(damaging, 4)
        code, printed, err = run_cli(*STOPPED, "--save-every", "1", "--out", str(out), capsys=capsys)
    assert code == 1 and "Traceback" not in err and "step 2/4" in printed and "step 3/4" not in printed, err[-3000:]
    stop, error = err.strip().splitlines()
    checkpoint = out / "checkpoints" / "step-2"
    prefix = f"stopped by a data error after step 2; last checkpoint: {checkpoint}; resume with: "
    assert stop.startswith(prefix), stop
    assert error == (f"offload-finetune: error: {message}. Fix it in --data {SAMPLE} itself, then resume with the "
                     "command above: the resume reads the same stream again, to the checkpoint's step and on, and "
                     "would stop at this record again"), error
    program, *argv = shlex.split(stop.removeprefix(prefix))
    assert program == "offload-finetune" and argv[-2:] == ["--resume", str(checkpoint)]
    code, printed, err = cli_result(cli.main, argv, capsys)
    assert code == 0 and f"resumed from {checkpoint} after step 2" in printed and "step 4/4" in printed, err[-3000:]


def test_data_damaged_before_any_checkpoint_says_to_run_again(tmp_path, capsys, monkeypatch):
    message = damaged_after(monkeypatch, 4)
    code, _, err = run_cli(*STOPPED, "--out", str(tmp_path / "out"), capsys=capsys)
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines() == [
        "stopped by a data error after step 2; no checkpoint was saved (--save-every N saves one every N steps)",
        f"offload-finetune: error: {message}. Fix it in --data {SAMPLE}, then run again"]


# -- a resume reads the data the saved run read ------------------------------------------------------------------


def test_a_resume_with_other_data_options_is_refused_naming_each(tmp_path, capsys, monkeypatch):
    """Each changed option of the training stream with its old and new value, not --eval-file, which
    the training batches do not read; --data at another path is noted, not refused (data moved to
    another disk is the same data), and the same file named from another directory is the same
    --data; a resume with the saved run's options goes on."""
    out = tmp_path / "out"
    text = tmp_path / "corpus.txt"
    text.write_text(SAMPLE.read_text())
    other = tmp_path / "other.txt"
    other.write_text(SAMPLE.read_text()[::-1])
    saved = ["--out", str(out), "--save-every", "1", "--data", str(text)]
    code, _, err = run_cli(*saved, "--steps", "2", capsys=capsys)
    assert code == 0, err[-3000:]
    code, printed, err = run_cli(*saved, "--steps", "3", "--resume", "latest", "--seed", "7", "--batch-size", "3",
                                 "--data", str(other), "--eval-file", str(text), capsys=capsys)
    note, line = err.strip().splitlines()
    assert code == 1 and "step 3/3" not in printed, err[-3000:]
    checkpoint = out / "checkpoints" / "step-2"
    assert note == (f"note: --resume: checkpoint {checkpoint} was saved by a run that read --data {text}, this one "
                    f"reads {other}: the batches are that run's only if the two hold the same data"), note
    assert line == (f"offload-finetune: error: --resume: checkpoint {checkpoint} was saved by a run that read its data "
                    f"otherwise (--seed was 0, now 7; --batch-size was 2, now 3), so the batches would differ from "
                    "those that run would have drawn (the resume replays its block stream to step 2): pass the old values to resume it, or "
                    f"start a new run: choose another --out, or remove {out / 'checkpoints'}, and leave out --resume and pass "
                    "--overwrite"), line
    monkeypatch.chdir(tmp_path)
    code, printed, err = run_cli(*saved[:-1], "corpus.txt", "--steps", "3", "--resume", "latest", capsys=capsys)
    assert code == 0 and f"resumed from {checkpoint} after step 2" in printed and "step 3/3" in printed, err[-3000:]
    assert "note:" not in err


def resumed(out: Path, saved: list[str], resuming: list[str], capsys) -> tuple[str, list[str]]:
    """Two steps saved with the options ``saved``, resumed to a third with ``resuming``: the resumed
    run's final loss and its notes."""
    code, _, err = run_cli("--out", str(out), "--save-every", "1", "--steps", "2", *saved, capsys=capsys)
    assert code == 0, err[-3000:]
    code, printed, err = run_cli("--out", str(out), "--save-every", "1", "--steps", "3", "--resume", "latest",
                                 *resuming, capsys=capsys)
    assert code == 0 and "after step 2" in printed and "step 3/3" in printed, err[-3000:]
    return re.search(r"final loss (\S+);", printed)[1], [line for line in err.splitlines() if "note:" in line]


def eval_note(out: Path, listed: str) -> str:
    return (f"note: --resume: checkpoint {out / 'checkpoints' / 'step-2'} was saved by a run that evaluated otherwise "
            f"({listed}): the evaluation figures are not comparable with that run's, the training batches are the same")


def test_a_resume_adding_an_eval_file_goes_on_with_a_note_and_trains_as_one_without(tmp_path, capsys):
    """--eval-file decides what an evaluation reads, not the training stream: a resume that adds it
    draws the batches of one that does not, to the same loss, and says its evaluation figures differ."""
    val = tmp_path / "val.txt"
    val.write_text(SAMPLE.read_text())
    loss, notes = resumed(tmp_path / "without", [], [], capsys)
    assert notes == []
    loss_with, notes = resumed(tmp_path / "with", [], ["--eval-file", str(val)], capsys)
    assert notes == [eval_note(tmp_path / "with", f"--eval-file was unset, now {val}")]
    assert loss_with == loss


@pytest.mark.parametrize("change", ["dropped", "another file", "fewer batches"])
def test_a_resume_with_other_eval_options_goes_on_with_a_note(change, tmp_path, capsys):
    val, other = tmp_path / "val.txt", tmp_path / "other.txt"
    val.write_text(SAMPLE.read_text())
    other.write_text(SAMPLE.read_text()[::-1])
    resuming, listed = {"dropped": ([], f"--eval-file was {val}, now unset"),
                        "another file": (["--eval-file", str(other)], f"--eval-file was {val}, now {other}"),
                        "fewer batches": (["--eval-file", str(val), "--eval-batches", "2"],
                                          "--eval-batches was 8, now 2")}[change]
    _, notes = resumed(tmp_path / "out", ["--eval-file", str(val)], resuming, capsys)
    assert notes == [eval_note(tmp_path / "out", listed)]


def test_the_shipped_sample_is_recorded_as_itself_wherever_the_package_is(tmp_path):
    """--data's default moves with the installation (another virtual environment, a clone beside the
    installed package): a checkpoint records it by name, not by path."""
    import argparse

    from offload.cli import finetune_resume
    from offload.cli.finetune_args import DEFAULT_TEXT

    options = dict.fromkeys(finetune_resume.DATA_OPTIONS)
    assert finetune_resume.data_options(argparse.Namespace(**{**options, "data": DEFAULT_TEXT}))["data"] == \
        finetune_resume.SAMPLE
    assert finetune_resume.data_options(argparse.Namespace(**{**options, "data": tmp_path}))["data"] == str(tmp_path)


def test_a_checkpoint_saved_without_the_record_resumes_as_before(tmp_path, capsys, monkeypatch):
    """Saved before checkpoints recorded the data options: nothing to compare, the resume goes on."""
    save = cli.save_checkpoint

    def as_before(path, model, optimizer, *, extra, **kwargs):
        save(path, model, optimizer, extra={"step": extra["step"]}, **kwargs)

    out = tmp_path / "out"
    with monkeypatch.context() as older:
        older.setattr(cli, "save_checkpoint", as_before)
        code, _, err = run_cli("--out", str(out), "--save-every", "1", "--steps", "1", capsys=capsys)
    assert code == 0, err[-3000:]
    code, printed, err = run_cli("--out", str(out), "--save-every", "1", "--steps", "2", "--resume", "latest",
                                 "--seed", "7", capsys=capsys)
    assert code == 0 and "after step 1" in printed and "step 2/2" in printed, err[-3000:]


# -- --eval-file of a DatasetDict ------------------------------------------------------------------------------


def test_an_eval_file_dataset_dict_is_evaluated_on_its_validation_split_not_its_training_rows(tmp_path, capsys,
                                                                                               monkeypatch):
    datasets = pytest.importorskip("datasets")
    import argparse

    from offload.cli.finetune_data import Batches
    from offload.cli.models import byte_tokenizer

    both = tmp_path / "both"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["T" * 40] * 4}),
                          "validation": datasets.Dataset.from_dict({"text": ["V" * 40] * 4})}).save_to_disk(both)
    args = argparse.Namespace(data=both, eval_file=both, eval_fraction=0.0, eval_batches=1, batch_size=2, seq_len=16,
                              text_field=None, seed=0, shuffle_buffer=1, grad_accum=1)
    evaluated = {token for batch in Batches(args, byte_tokenizer()).evaluation() for row in batch
                 for token in row.tolist()}
    assert ord("V") in evaluated and ord("T") not in evaluated, sorted(evaluated)
    # A DatasetDict with neither a validation nor a test split, and several: refused for --eval-file
    # before the model is built (--data reads its train split).
    other = tmp_path / "other"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["T" * 40] * 4}),
                          "extra": datasets.Dataset.from_dict({"text": ["E" * 40] * 4})}).save_to_disk(other)
    built = watch_builds(monkeypatch)
    code, _, err = run_cli("--out", str(tmp_path / "out"), "--steps", "1", "--data", str(other),
                           "--eval-file", str(other), capsys=capsys)
    assert code != 0 and built == [] and "validation" in err and "extra" in err, err[-2000:]
