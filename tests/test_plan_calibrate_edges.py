"""Edges of ``offload calibrate`` and ``offload plan``: a rates file written whole or not at all
(a full disk leaves the old one, and the measured rates on stdout; a link is written through,
a file keeps its mode), Ctrl-C in one line, a CPU
plan's printed command run on the CPU, ``--device-memory`` refused for a CPU device, and a rates
file with an integer past a float's range refused in one line. Nothing is measured: ``calibrate``
is replaced by one that returns fixed rates."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import offload.cli.calibrate
import offload.planning.rates
from offload.cli.main import main
from offload.planning.rates import GPU_DEFAULTS, MachineRates, load_rates

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
              "tie_word_embeddings": False}
#: A CPU device's rates, as `offload calibrate --device cpu` writes them: no link, no device memory.
CPU_RATES = GPU_DEFAULTS["a100"].to_json() | {"name": "calibrated: CPU test", "host_to_device": 0.0,
                                               "device_to_host": 0.0, "device_memory": None}
CPU_PLAN = ["--hf-config", "tiny.json", "--device", "cpu", "--host-memory", "8", "--rates", "cpu.json",
            "--seq-len", "32", "--batch-size", "2"]


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory, with a model config, CPU rates and an old rates file; nothing measured."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(offload.cli.calibrate, "calibrate",
                        lambda directory, device: MachineRates.from_json(CPU_RATES))
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "cpu.json").write_text(json.dumps(CPU_RATES))
    (tmp_path / "old.json").write_text(json.dumps(GPU_DEFAULTS["a100"].to_json()))
    return tmp_path


def _failing_write(*args: object, **kwargs: object) -> None:
    raise OSError(28, "No space left on device")


def test_a_full_disk_keeps_the_old_rates_and_prints_the_measured_ones(where, monkeypatch, capsys):
    old = (where / "old.json").read_text()
    monkeypatch.setattr(offload.planning.rates.os, "fsync", _failing_write)  # mid-write, after the temp file
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--out", "old.json"])
    out, err = capsys.readouterr()
    assert exit_info.value.code != 0 and "Traceback" not in err
    message = str(exit_info.value.code)
    assert "\n" not in message and "cannot write --out old.json (No space left on device)" in message
    assert json.loads(out) == CPU_RATES  # the minute of measuring is not lost
    assert (where / "old.json").read_text() == old
    assert sorted(p.name for p in where.iterdir()) == ["cpu.json", "old.json", "tiny.json"]  # no temp file


def test_rates_are_written_whole_and_readable(where, capsys):
    main(["calibrate", "--out", "new/rates.json"])
    assert f"written to new{os.sep}rates.json" in capsys.readouterr().out
    assert load_rates(where / "new" / "rates.json").to_json() == CPU_RATES
    assert os.stat(where / "new" / "rates.json").st_mode & 0o777 == 0o644
    assert os.listdir(where / "new") == ["rates.json"]


def test_a_linked_rates_file_is_written_through_the_link(where, capsys):
    (where / "kept").mkdir()
    (where / "kept" / "rates.json").write_text("{}")
    (where / "linked.json").symlink_to(where / "kept" / "rates.json")
    main(["calibrate", "--out", "linked.json"])
    assert (where / "linked.json").is_symlink()
    assert load_rates(where / "kept" / "rates.json").to_json() == CPU_RATES
    assert os.listdir(where / "kept") == ["rates.json"]


def test_the_file_keeps_its_mode_and_a_new_one_gets_the_umasks(where, capsys):
    os.chmod(where / "old.json", 0o640)
    main(["calibrate", "--out", "old.json"])
    assert os.stat(where / "old.json").st_mode & 0o777 == 0o640
    umask = os.umask(0o077)
    try:
        main(["calibrate", "--out", "private.json"])
    finally:
        os.umask(umask)
    assert os.stat(where / "private.json").st_mode & 0o777 == 0o600


def test_ctrl_c_during_calibrate_is_one_line_with_exit_status_130(where, monkeypatch, capsys):
    def interrupted(directory: object, device: object) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(offload.cli.calibrate, "calibrate", interrupted)
    old = (where / "old.json").read_text()
    with pytest.raises(SystemExit) as exit_info:
        try:
            main(["calibrate", "--out", "old.json"])
        except KeyboardInterrupt:  # let through, it would end this pytest run too
            pytest.fail("Ctrl-C came through as a KeyboardInterrupt traceback")
    err = capsys.readouterr().err
    assert exit_info.value.code == 130
    assert err.strip().splitlines() == ["offload calibrate: interrupted; nothing written (old.json unchanged)"]
    assert (where / "old.json").read_text() == old


def test_a_cpu_plans_finetune_command_runs_on_the_cpu(where, capsys):
    main(["plan", *CPU_PLAN, "--json"])
    assert json.loads(capsys.readouterr().out)["chosen"]["finetune"].endswith(" --device cpu")


def _plan_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("offload plan: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_device_memory_for_a_cpu_device_is_refused(where, capsys):
    # It was shown as a limit and never checked: a CPU device's memory is the host's.
    line = _plan_error(capsys, *CPU_PLAN, "--device-memory", "0.0001")
    assert line == ("offload plan: error: --device-memory with --device cpu: a CPU device's memory is the host's: "
                    "use --host-memory")


def test_a_rates_file_with_an_integer_past_a_float_is_one_line(where, capsys):
    (where / "huge.json").write_text(json.dumps(CPU_RATES)[:-1] + ', "host_copy": ' + "1" + "0" * 400 + "}")
    line = _plan_error(capsys, *[a if a != "cpu.json" else "huge.json" for a in CPU_PLAN])
    assert "--rates huge.json: rates file: host_copy must be a number above 0" in line
