"""Configuration discovery and validation."""

from __future__ import annotations

import pytest

from torchaxe.config import find_config
from torchaxe.errors import TorchaxeError


def test_no_config_is_empty(tmp_path):
    assert find_config(tmp_path).values == {}


def test_pyproject_table_found_from_a_subfolder(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.torchaxe]\ntarget = "cuda"\nselect = ["AX2", "AX3"]\njobs = 2\n')
    sub = tmp_path / "src" / "pkg"
    sub.mkdir(parents=True)
    config = find_config(sub)
    assert config.values == {"target": "cuda", "select": ["AX2", "AX3"], "jobs": 2}
    assert config.source == tmp_path / "pyproject.toml"


def test_pyproject_without_table_is_skipped(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.torchaxe]\ntarget = "npu"\n')
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "x"\n')
    assert find_config(inner).get("target") == "npu"


def test_torchaxe_toml_wins_in_its_folder(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.torchaxe]\ntarget = "npu"\n')
    (tmp_path / "torchaxe.toml").write_text('target = "cpu"\n')
    assert find_config(tmp_path).get("target") == "cpu"


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[tool.torchaxe]\nselect = 'AX2'\n", "must be a list"),
        ("[tool.torchaxe]\njobs = true\n", "must be an integer"),
        ("[tool.torchaxe]\nselect = [1]\n", "list of strings"),
        ("[tool.torchaxe\n", "invalid TOML"),
    ],
)
def test_bad_values_are_clear_errors(tmp_path, text, needle):
    (tmp_path / "pyproject.toml").write_text(text)
    with pytest.raises(TorchaxeError, match=needle):
        find_config(tmp_path)

