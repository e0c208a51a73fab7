"""The scan engine: which files it reads, what it reports about bad files, noqa,
rule selection, and that parallel scans give the same answer as serial ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torchaxe.errors import TorchaxeError
from torchaxe.scan.engine import ScanOptions, scan_paths

OPT = "import torch\nopt = torch.optim.AdamW(params)\n"


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_folder_scan_recurses_and_skips_files_without_torch(tmp_path):
    write(tmp_path / "a.py", OPT)
    write(tmp_path / "pkg" / "b.py", OPT)
    write(tmp_path / "pkg" / "plain.py", "print('no framework here')\n")
    write(tmp_path / "notes.txt", OPT)
    result = scan_paths([tmp_path], ScanOptions())
    assert result.stats.files_scanned == 2
    assert result.stats.files_skipped == 1
    assert sorted(Path(f.path).name for f in result.findings) == ["a.py", "b.py"]
    assert result.exit_code == 1


def test_files_no_rule_can_match_are_skipped_unparsed(tmp_path):
    write(tmp_path / "model.py", "import torch\nx = torch.ones(3)\ndef broken(:\n")
    result = scan_paths([tmp_path], ScanOptions(select=("AX201",)))
    assert result.stats.files_skipped == 1 and result.stats.files_scanned == 0
    assert not result.diagnostics and result.exit_code == 0


@pytest.mark.parametrize(
    ("code", "skipped", "kept"),
    [
        # "optim" alone (optimize, optimizer_state) is not enough: an optimizer class must be named.
        ("AX201", "import torch\n# optimize the graph\ndef broken(:\n",
         "import torch\nfrom torch import optim\nopt = optim.SGD(p, lr=0.1)\n"),
        # a word like "attention" in a comment is not a definition the rule inspects
        ("AX103", "import torch\n# attention: gelu below is fused\ndef broken(:\n",
         "import torch\nclass LlamaRMSNorm(torch.nn.Module):\n    pass\n"),
        ("AX203", "import torch\nx.grad.zero_()\ndef broken(:\n",
         "import torch\nfor p in m.parameters():\n    p.data -= 0.1 * p.grad\n"),
        ("AX404", "import torch\nfrom PIL import Image\ndef broken(:\n",
         "import torch\nfrom PIL import Image\nclass D:\n    def __getitem__(self, i):\n        return Image.open(i)\n"),
    ],
)
def test_second_prefilters_skip_files_the_rule_cannot_match(tmp_path, code, skipped, kept):
    write(tmp_path / "skipped.py", skipped)
    write(tmp_path / "kept.py", kept)
    result = scan_paths([tmp_path], ScanOptions(select=(code,)))
    assert result.stats.files_skipped == 1 and result.stats.files_scanned == 1
    assert not result.diagnostics  # the file that cannot parse was never parsed


def test_default_and_user_excludes(tmp_path):
    write(tmp_path / "keep.py", OPT)
    for folder in (".git", ".venv", "build", "__pycache__"):
        write(tmp_path / folder / "x.py", OPT)
    write(tmp_path / "generated" / "y.py", OPT)
    result = scan_paths([tmp_path], ScanOptions(exclude=("generated",)))
    assert [Path(f.path).name for f in result.findings] == ["keep.py"]


def test_noqa_silences_all_or_named_codes(tmp_path):
    src = (
        "import torch\n"
        "a = torch.optim.AdamW(p)  # noqa\n"
        "b = torch.optim.AdamW(p)  # noqa: AX201\n"
        "c = torch.optim.AdamW(p)  # noqa: AX301\n"
        "d = torch.optim.AdamW(p)  # NOQA:AX2\n"
    )
    write(tmp_path / "n.py", src)
    result = scan_paths([tmp_path], ScanOptions(select=("AX201",)))
    assert [f.line for f in result.findings] == [4]


def test_select_and_ignore_prefixes(tmp_path):
    write(tmp_path / "a.py", OPT)
    assert scan_paths([tmp_path], ScanOptions(select=("AX2",))).findings
    assert not scan_paths([tmp_path], ScanOptions(ignore=("AX2",))).findings
    assert not scan_paths([tmp_path], ScanOptions(select=("AX1",))).findings


def test_unknown_prefix_is_a_clear_error(tmp_path):
    with pytest.raises(TorchaxeError, match="matches no rule"):
        scan_paths([tmp_path], ScanOptions(select=("XY9",)))


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(TorchaxeError, match="no such file"):
        scan_paths([tmp_path / "nope"], ScanOptions())


def test_bad_files_become_diagnostics_and_the_scan_goes_on(tmp_path):
    write(tmp_path / "good.py", OPT)
    write(tmp_path / "syntax.py", "import torch\nopt = torch.optim.SGD(p)\ndef broken(:\n")
    write(tmp_path / "latin.py", b"import torch\nname = '\xe9t\xe9'\n")
    write(tmp_path / "declared.py", b"# -*- coding: latin-1 -*-\nimport torch\nname = '\xe9'\nopt = torch.optim.SGD(p)\n")
    result = scan_paths([tmp_path], ScanOptions())
    codes = {Path(d.path).name: d.code for d in result.diagnostics}
    assert codes == {"syntax.py": "AX901", "latin.py": "AX902"}
    assert {Path(f.path).name for f in result.findings} == {"good.py", "declared.py"}
    assert result.exit_code == 3


def test_old_pytorch_code_that_no_python_parses_says_why(tmp_path):
    # PyTorch before 0.4: `.cuda(async=True)`; `async` is a keyword since Python 3.7.
    write(tmp_path / "train.py", "import torch\nopt = torch.optim.SGD(p)\ny = x.cuda(async=True)\n")
    result = scan_paths([tmp_path], ScanOptions())
    (diagnostic,) = result.diagnostics
    assert diagnostic.code == "AX901" and diagnostic.line == 3
    assert "`non_blocking=True`" in diagnostic.message and diagnostic.message.startswith("cannot parse: ")
    write(tmp_path / "train.py", "import torch\nopt = torch.optim.SGD(p)\ndef broken(:\n")
    (diagnostic,) = scan_paths([tmp_path], ScanOptions()).diagnostics
    assert "non_blocking" not in diagnostic.message


def test_unreadable_file_is_a_diagnostic(tmp_path, monkeypatch):
    write(tmp_path / "ok.py", OPT)
    secret = write(tmp_path / "secret.py", OPT)
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == secret.name:
            raise PermissionError(13, "Permission denied")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    result = scan_paths([tmp_path], ScanOptions())
    assert [(Path(d.path).name, d.code) for d in result.diagnostics] == [("secret.py", "AX903")]
    assert "Permission denied" in result.diagnostics[0].message
    assert len(result.findings) == 1


def test_file_vanishing_mid_scan_is_a_diagnostic(tmp_path, monkeypatch):
    write(tmp_path / "a.py", OPT)
    gone = write(tmp_path / "b.py", OPT)
    import torchaxe.scan.engine as engine

    real = engine.scan_file

    def vanish_then_scan(path, options, rules, data=None):
        if path.name == "b.py" and gone.exists():
            gone.unlink()
        return real(path, options, rules, data)

    monkeypatch.setattr(engine, "scan_file", vanish_then_scan)
    result = scan_paths([tmp_path], ScanOptions())
    assert [(Path(d.path).name, d.code) for d in result.diagnostics] == [("b.py", "AX904")]
    assert len(result.findings) == 1


def test_symlink_loop_is_a_diagnostic(tmp_path):
    write(tmp_path / "pkg" / "a.py", OPT)
    (tmp_path / "pkg" / "loop").symlink_to(tmp_path / "pkg", target_is_directory=True)
    (tmp_path / "self").symlink_to(tmp_path / "self")
    result = scan_paths([tmp_path], ScanOptions())
    assert len(result.findings) == 1
    assert {d.code for d in result.diagnostics} == {"AX905"}


def test_a_crashing_rule_becomes_a_diagnostic(tmp_path, monkeypatch):
    from torchaxe.scan.rules.ax201_unfused_optimizer import UnfusedOptimizer

    def boom(self, node, ctx):
        raise ValueError("bug")

    monkeypatch.setattr(UnfusedOptimizer, "visit", boom)
    write(tmp_path / "a.py", OPT)
    result = scan_paths([tmp_path], ScanOptions(select=("AX201",)))
    assert [d.code for d in result.diagnostics] == ["AX906"]
    assert "bug" in result.diagnostics[0].message


def test_scan_never_imports_the_scanned_code(tmp_path):
    marker = tmp_path / "ran"
    write(tmp_path / "evil.py", f"import torch\nopen({str(marker)!r}, 'w').write('x')\nopt = torch.optim.SGD(p)\n")
    result = scan_paths([tmp_path], ScanOptions())
    assert result.findings and not marker.exists()
    assert "evil" not in sys.modules


def test_parallel_scan_matches_serial(tmp_path):
    for i in range(120):
        write(tmp_path / f"m{i:03}.py", OPT if i % 3 else "import torch\nx = 1\n")
    serial = scan_paths([tmp_path], ScanOptions(jobs=1))
    parallel = scan_paths([tmp_path], ScanOptions(jobs=2))
    assert [f.to_dict() for f in serial.findings] == [f.to_dict() for f in parallel.findings]
    assert serial.stats.files_scanned == parallel.stats.files_scanned == 80
    assert serial.stats.files_skipped == parallel.stats.files_skipped == 40


def test_columns_count_characters_not_bytes(tmp_path):
    write(tmp_path / "u.py", "import torch\nnom = 'é'; opt = torch.optim.SGD(p)\n")
    (f,) = scan_paths([tmp_path], ScanOptions(select=("AX201",))).findings
    assert f.col == len("nom = 'é'; opt = ") + 1


def test_prefilter_reads_accumulation_files_and_every_ddp_building_file():
    """AX601 reads a file with a backward and a word of accumulation, and any file
    that builds DDP (for what it imports), but not torch's many files that only say
    "accumulate"."""
    from torchaxe.scan.engine import _applicable
    from torchaxe.scan.rules import get_rule

    rule = get_rule("AX601")()

    def reads(source: str) -> bool:
        return bool(_applicable([rule], source, "cpu"))

    assert reads("loss.backward()\nif (i + 1) % accum_steps == 0:\n    opt.step()\n")
    assert reads("loss_scaler(loss, opt, update_grad=(i + 1) % accum_iter == 0)\n")
    assert reads("from torch.nn.parallel import DistributedDataParallel\nimport engine\n")
    assert not reads("def accumulate(xs):\n    return sum(xs)\n")
    assert not reads("loss.backward()\nopt.step()\n")


def test_word_finder_agrees_with_substring_search_with_or_without_the_automaton():
    """The prefilter finds every rule's words in one pass; without pyahocorasick it
    searches word by word. Both read every word as a plain substring, overlapping and
    nested ones included."""
    from torchaxe.scan.engine import _WordFinder

    words = ["gelu", "new_gelu", "softmax(", ".softmax\n", "for ", "opt", "optim", "ab", "b"]
    texts = ["def new_gelu(x):\n    for i in y: x.softmax\n", "optimizer = 1", "", "abab", "nothing"]
    automaton = _WordFinder(words)
    assert automaton.automaton is not None
    plain = _WordFinder(words)
    plain.automaton = None
    for text in texts:
        expected = {w for w in words if w in text}
        for finder in (automaton, plain):
            holds = finder.finder(text)
            assert {w for w in words if holds(w)} == expected, (text, finder.automaton)
    assert _WordFinder([]).finder("gelu")("gelu") is True  # no words: word by word


@pytest.mark.parametrize(("text", "found"), [
    ("class NewGELUActivation(nn.Module):\n", True),
    ("    def gelu(x):\n", True),
    ("\tasync def attention(q, k, v):\n", True),
    ("def RMSNorm(x):\n", True),  # any case
    ("x = 1  # def gelu(x) would be nice\n", False),
    ("def gelu_approximate(x):\n", False),
    ("def  silu (x):\n", True),
    ("print('class gelu')\n", False),
])
def test_ax103_definition_pattern(text, found):
    from torchaxe.scan.rules import get_rule

    assert bool(get_rule("AX103").requires_pattern.search("import torch\n" + text)) is found


@pytest.mark.parametrize(("code", "text", "found"), [
    ("AX205", "ema = d * ema + (1 - d) * p\n", True),
    ("AX205", "ema = d * ema + (1.0-d) * p\n", True),
    ("AX205", "x = 11 - d\n", False),
    ("AX205", "x = a1 - d\n", False),
    ("AX205", "x = y.lerp(z, 0.1)\n", True),
    ("AX603", "loss.backward ()\n", True),
    ("AX603", "self.optimizers[0]\n", True),
    ("AX603", "readoptions = 1\n", False),
    ("AX603", "opts = [a]\n", True),
    ("AX603", "x.opt.zero_grad()\n", True),
    ("AX603", "adopt = 1\noptional = 2\n", False),
    ("AX603", "optimiser = make()\n", True),
])
def test_rewritten_text_patterns_keep_their_word_boundaries(code, text, found):
    from torchaxe.scan.rules import get_rule

    assert bool(get_rule(code).requires_pattern.search(text)) is found


def test_files_no_formula_rule_asks_about_need_no_evaluator_on_the_next_scan(tmp_path):
    """A parallel scan starts the evaluator (which imports torch) unless every file is
    known to need no formula evaluation. A file no formula rule reads, and one AX103
    reads for ``def gelu`` without asking for formula matches (the body does no math),
    are marked so by the scan that finds it; a file whose formulas were analysed has
    its results stored."""
    from torchaxe.scan.engine import all_stored
    from torchaxe.scan.rules import all_rules

    sources = [
        "import torch\ndef gelu(x: int) -> torch.dtype:\n    return torch.float32  # v3\n",
        "import torch\nopt = torch.optim.AdamW(p)  # v3\n",
        "import torch\ndef gelu(x):\n    return 0.5 * x * (1 + torch.erf(x / 1.4142135623730951))  # v3\n",
    ]
    for i, source in enumerate(sources):
        write(tmp_path / f"m{i}.py", source)
    codes = sorted(r.code for r in all_rules() if r.uses_formulas)
    assert not any(all_stored([source], "cpu", codes) for source in sources)
    scan_paths([tmp_path], ScanOptions(jobs=1))
    assert all_stored(sources, "cpu", codes)
    assert not all_stored(sources[:2], "cpu", codes[:-1])  # another selection of rules
    assert not all_stored(sources[:2], "npu", codes)


def test_child_fields_keep_the_name_node_of_a_type_alias():
    # Python 3.12's `type Vector = list[float]`: TypeAlias.name is a Name node, while a
    # function's or a class's `name` is a string.
    import ast

    from torchaxe.scan.context import child_fields

    alias = type("TypeAlias", (ast.stmt,), {"_fields": ("name", "type_params", "value")})
    assert child_fields(alias) == ("name", "type_params", "value")
    assert "name" not in child_fields(ast.FunctionDef) and "body" in child_fields(ast.FunctionDef)
