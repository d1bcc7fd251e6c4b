"""``offload-finetune --resume`` and a finished model in ``--out``, and data files that open with a
byte-order mark.

A resume exports over ``--out`` as a new run does, so a finished model there is kept unless the
resume continues that model's run (Note: [Never lose a run], rule 6, in ``offload/cli/finetune.py``):
a checkpoint of another ``--out``, or an older checkpoint of the run that finished resumed to fewer
steps, is refused before anything is built, unless ``--overwrite``; the resume of a run that was to
replace an earlier run's model, or of the finished run to train on past it, goes on. A UTF-8 file
that opens with a byte-order mark (Notepad's, PowerShell 5's ``Out-File``) reads as the same file
without it.
"""

from __future__ import annotations

import argparse
import codecs
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from offload.cli import finetune as cli  # noqa: E402
from offload.cli.models import byte_tokenizer  # noqa: E402
from offload.cli.outputs import (EXPORT_RECORD, OutputError, check_resume_keeps_finished_model,  # noqa: E402
                                 mark_export)
from offload.integrations.data import check_readable, token_blocks  # noqa: E402
from .helpers import cli_result  # noqa: E402

TINY = ["--device", "cpu", "--no-progress", "--batch-size", "2", "--seq-len", "16", "--num-slices", "3"]


def run_cli(*args: str, capsys) -> tuple[int, str, str]:
    return cli_result(cli.main, [*TINY, *args], capsys)


def files_of(directory: Path) -> dict[str, bytes]:
    """The bytes of the files directly in ``directory``, by name."""
    return {f.name: f.read_bytes() for f in sorted(directory.iterdir()) if f.is_file()}


def watch_builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The models the run builds, recorded as it builds them."""
    built: list[tuple] = []
    build = cli.random_model
    monkeypatch.setattr(cli, "random_model", lambda *args: built.append(args) or build(*args))
    return built


def test_a_resume_of_another_outs_checkpoint_into_a_finished_model_is_refused(tmp_path, capsys, monkeypatch):
    """It replaced the model with the other run's, continued: refused before anything is built,
    the model untouched; with --overwrite it replaces it, as asked."""
    finished, other = tmp_path / "finished", tmp_path / "other"
    for args in (["--out", str(finished), "--steps", "3"], ["--out", str(other), "--steps", "2", "--save-every", "2"]):
        code, _, err = run_cli(*args, capsys=capsys)
        assert code == 0, err[-3000:]
    kept = files_of(finished)
    checkpoint = other / "checkpoints" / "step-2"
    resume = ["--out", str(finished), "--steps", "4", "--resume", str(checkpoint)]
    built = watch_builds(monkeypatch)
    code, printed, err = run_cli(*resume, capsys=capsys)
    assert err.strip() == (f"offload-finetune: error: --out {finished} holds a finished model, which this run's export "
                           f"would replace, and --resume {checkpoint} is not one of its checkpoints (under "
                           f"{finished / 'checkpoints'}): choose another --out, or pass --overwrite to replace it")
    assert code == 1 and built == [] and printed == ""
    assert files_of(finished) == kept
    code, printed, err = run_cli(*resume, "--overwrite", capsys=capsys)
    assert code == 0 and "resumed from" in printed and "step 3/4" in printed, err[-3000:]
    assert json.loads((finished / EXPORT_RECORD).read_text()) == {"step": 4, "finished": True}


def test_an_older_checkpoint_of_the_finished_run_resumed_to_fewer_steps_is_refused(tmp_path, capsys, monkeypatch):
    """holds_finished_model's promise, "an older checkpoint resumed by mistake is refused", kept for
    a resume that trains: a model of step 3 is not replaced by one of step 2. Resumed to its own
    --steps, the run trains the same model again, bit for bit; past them, it trains on."""
    out = tmp_path / "out"
    flags = ["--out", str(out), "--save-every", "1"]
    code, _, err = run_cli(*flags, "--steps", "3", capsys=capsys)
    assert code == 0, err[-3000:]
    kept = files_of(out)
    first = str(out / "checkpoints" / "step-1")
    built = watch_builds(monkeypatch)
    code, printed, err = run_cli(*flags, "--steps", "2", "--resume", first, capsys=capsys)
    assert err.strip() == (f"offload-finetune: error: --out {out} holds a finished model of step 3, which this run's "
                           "export of step 2 would replace: pass --steps N > 3 to train on past it, or choose another "
                           "--out, or pass --overwrite to replace it")
    assert code == 1 and built == [] and printed == ""
    assert files_of(out) == kept
    code, printed, err = run_cli(*flags, "--steps", "3", "--resume", first, capsys=capsys)
    assert code == 0 and "step 2/3" in printed, err[-3000:]
    assert files_of(out) == kept
    code, printed, err = run_cli(*flags, "--steps", "4", "--resume", "latest", capsys=capsys)
    assert code == 0 and "step 4/4" in printed and "step 3/4" not in printed, err[-3000:]
    assert json.loads((out / EXPORT_RECORD).read_text()) == {"step": 4, "finished": True}


def test_a_resume_of_a_run_that_was_to_replace_an_earlier_runs_model_goes_on(tmp_path, capsys, monkeypatch):
    """A run with --overwrite into the --out of an earlier, shorter run, stopped before its export:
    the earlier model is still there, finished, and its resume (with or without --overwrite) replaces
    it, as the run was going to."""
    out = tmp_path / "out"
    code, _, err = run_cli("--out", str(out), "--steps", "1", capsys=capsys)
    assert code == 0, err[-3000:]
    save = cli.save_checkpoint

    def interrupted_at_the_last(path, *args, **kwargs):
        if path.name == "step-3":
            raise KeyboardInterrupt
        return save(path, *args, **kwargs)

    flags = ["--out", str(out), "--steps", "3", "--save-every", "1"]
    with monkeypatch.context() as stopping:
        stopping.setattr(cli, "save_checkpoint", interrupted_at_the_last)
        code, _, err = run_cli(*flags, "--overwrite", capsys=capsys)
    assert code == 130 and "last checkpoint: " in err, err[-3000:]
    assert json.loads((out / EXPORT_RECORD).read_text()) == {"step": 1, "finished": True}
    code, printed, err = run_cli(*flags, "--resume", "latest", capsys=capsys)
    assert code == 0 and "resumed from" in printed and "step 3/3" in printed, err[-3000:]
    assert json.loads((out / EXPORT_RECORD).read_text()) == {"step": 3, "finished": True}


def test_a_model_without_a_finished_record_of_its_step_counts_as_finished_for_a_resume(tmp_path):
    """Weights without an export record (written before it existed, or by something else), or with
    one that does not read, are taken for a finished model of an unknown step; an export that was
    stopped half way ("finished": false) is no finished model."""
    out = tmp_path / "out"
    (out / "checkpoints" / "step-1").mkdir(parents=True)
    args = argparse.Namespace(out=out, resume=out / "checkpoints" / "step-1", steps=5, overwrite=False)
    check_resume_keeps_finished_model(args)  # nothing there
    (out / "model.safetensors").write_bytes(b"")
    refusal = (f"--out {out} holds a finished model, which this run's export would replace: choose another --out, "
               "or pass --overwrite to replace it")
    with pytest.raises(OutputError) as refused:
        check_resume_keeps_finished_model(args)
    assert str(refused.value) == refusal
    (out / EXPORT_RECORD).write_text("{not json")
    with pytest.raises(OutputError) as refused:
        check_resume_keeps_finished_model(args)
    assert str(refused.value) == refusal
    mark_export(out, 9, finished=False)
    check_resume_keeps_finished_model(args)
    mark_export(out, 5, finished=True)  # this run's steps: its run's own model, trained again
    check_resume_keeps_finished_model(args)
    mark_export(out, 6, finished=True)
    with pytest.raises(OutputError, match="holds a finished model of step 6, which this run's export of step 5"):
        check_resume_keeps_finished_model(args)
    check_resume_keeps_finished_model(argparse.Namespace(**{**vars(args), "overwrite": True}))


# -- a byte-order mark ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_a_utf8_file_that_opens_with_a_byte_order_mark_reads_as_the_file_without_it(suffix, tmp_path):
    """A JSON lines file was refused after the model was built, "Unexpected UTF-8 BOM (decode using
    utf-8-sig)", advice a command-line user cannot follow; plain text trained on the mark's bytes."""
    texts = [f"document {i}: caf\u00e9 na\u00efve" for i in range(40)]
    body = "".join(json.dumps({"text": t}) + "\n" for t in texts) if suffix == ".jsonl" else "\n".join(texts)
    plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"marked{suffix}"
    plain.write_bytes(body.encode("utf-8"))
    marked.write_bytes(codecs.BOM_UTF8 + body.encode("utf-8"))
    check_readable(marked)  # the check before the model is built agrees: UTF-8
    tokenizer = byte_tokenizer()
    expected = [block.tolist() for block in token_blocks(plain, tokenizer, 16)]
    assert len(expected) > 10
    assert [block.tolist() for block in token_blocks(marked, tokenizer, 16)] == expected
