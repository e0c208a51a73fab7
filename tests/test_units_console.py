"""The shared duration formatter and command-line helpers."""

from __future__ import annotations

import pytest

from torchaxe.console import progress_printer, write_output, writable_path
from torchaxe.errors import TorchaxeError
from torchaxe.units import duration


def test_duration_keeps_each_report_s_format():
    assert duration(0.0012345, 2) == "1.23 ms"  # advice, trials
    assert duration(0.0012345, 3, missing="-") == "1.234 ms" and duration(None, 3, missing="-") == "-"  # tune, kb
    assert [duration(s) for s in (0.00123, 0.5, 1.5, 12.34)] == ["1.23 ms", "500.0 ms", "1.50 s", "12.3 s"]
    assert duration(1.5, in_seconds=False) == "1500.0 ms"  # data
    assert duration(None) == duration(float("nan")) == "n/a"


def test_write_output_refuses_a_folder_and_a_missing_folder(tmp_path, capsys):
    with pytest.raises(TorchaxeError, match="--out .*: is a folder"):
        write_output("x", str(tmp_path), "--out")
    with pytest.raises(TorchaxeError, match=r"folder .*missing does not exist"):
        writable_path(tmp_path / "missing" / "f.txt")
    write_output("text\n", str(tmp_path / "f.txt"))
    write_output("out\n", "-")
    assert (tmp_path / "f.txt").read_text() == "text\n" and capsys.readouterr().out == "out\n"


def test_progress_lines_go_to_stderr_with_the_verb(capsys):
    progress_printer("data")("sampling [3/4]")
    progress_printer("data", quiet=True)("not shown")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "torchaxe data: sampling [3/4]\n"
