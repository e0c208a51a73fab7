"""Apply fixes: edits in text order, the imports they need added once, the result
checked to parse, and the file replaced atomically (or a diff shown instead)."""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from torchaxe.atomic import write_text_atomic
from torchaxe.errors import TorchaxeError
from torchaxe.findings import Applicability, Diagnostic, Finding, Fix
from torchaxe.scan.engine import ScanOptions, decode_source, display_path, parse_failure, scan_source
from torchaxe.scan.discover import discover
from torchaxe.scan.rules import select_rules

#: Rescans after applying, so fixes that overlapped an applied one get their turn.
MAX_PASSES = 8


@dataclass
class FileFix:
    path: str
    original: str
    fixed: str
    applied: list[Finding] = field(default_factory=list)
    remaining: list[Finding] = field(default_factory=list)
    error: str | None = None

    @property
    def changed(self) -> bool:
        return self.error is None and self.fixed != self.original

    def diff(self) -> str:
        return "".join(
            difflib.unified_diff(
                self.original.splitlines(keepends=True),
                self.fixed.splitlines(keepends=True),
                fromfile=self.path if self.path.startswith("/") else f"a/{self.path}",
                tofile=self.path if self.path.startswith("/") else f"b/{self.path}",
            )
        )


@dataclass
class FixResult:
    files: list[FileFix] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)

    @property
    def applied(self) -> int:
        return sum(len(f.applied) for f in self.files if f.changed)

    @property
    def remaining(self) -> int:
        return sum(len(f.remaining) for f in self.files)


def is_applicable(fix: Fix | None, unsafe: bool | frozenset[str], code: str = "") -> bool:
    """Whether ``fix`` is applied: a safe one always, an unsafe one when ``unsafe``
    is True or names ``code`` (a set of rule codes)."""
    if fix is None or not fix.edits:
        return False
    if fix.applicability is Applicability.SAFE:
        return True
    allowed = unsafe if isinstance(unsafe, bool) else code in unsafe
    return allowed and fix.applicability is Applicability.UNSAFE


def _offset(starts: list[int], line: int, col: int) -> int:
    return starts[min(line - 1, len(starts) - 1)] + col - 1


def _line_starts(source: str) -> list[int]:
    starts, total = [0], 0
    for text in source.splitlines(keepends=True):
        total += len(text)
        starts.append(total)
    return starts


def apply_edits(source: str, fixes: list[Fix]) -> tuple[str, list[int]]:
    """Apply non-overlapping fixes in text order. Returns the new text and the indexes
    of the fixes applied; a fix that overlaps an earlier one is left for a later pass."""
    starts = _line_starts(source)
    taken: list[tuple[int, int]] = []
    chosen: list[tuple[int, int, str]] = []
    applied: list[int] = []
    order = sorted(range(len(fixes)), key=lambda i: min((e.start for e in fixes[i].edits)))
    for i in order:
        spans = [
            (_offset(starts, e.start.line, e.start.col), _offset(starts, e.end.line, e.end.col), e.content)
            for e in fixes[i].edits
        ]
        if any(_overlaps(a, b, ta, tb) for a, b, _ in spans for ta, tb in taken):
            continue
        taken.extend((a, b) for a, b, _ in spans)
        chosen.extend(spans)
        applied.append(i)
    out = source
    for a, b, content in sorted(chosen, key=lambda s: (s[0], s[1]), reverse=True):
        out = out[:a] + content + out[b:]
    return out, applied


def _overlaps(a: int, b: int, ta: int, tb: int) -> bool:
    if a == b == ta == tb:
        return True  # two insertions at one point: order would be ambiguous
    return a < tb and ta < b


def add_imports(source: str, imports: list[str]) -> str:
    """Add each import statement unless the module already binds it, after the
    leading block of imports (after the docstring and ``__future__`` imports when the
    module has no other import)."""
    tree = ast.parse(source)
    missing = [imp for imp in dict.fromkeys(imports) if not _has_import(tree, imp)]
    if not missing:
        return source
    body = tree.body
    insert_after = 0  # line number after which to insert (0: top of file)
    index = 0
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
        insert_after = body[0].end_lineno or 0
        index = 1
    while index < len(body) and isinstance(body[index], (ast.Import, ast.ImportFrom)):
        insert_after = body[index].end_lineno or insert_after
        index += 1
    lines = source.splitlines(keepends=True)
    if insert_after and lines and not lines[insert_after - 1].endswith("\n"):
        lines[insert_after - 1] += "\n"
    lines[insert_after:insert_after] = [f"{imp}\n" for imp in missing]
    return "".join(lines)


def _module_level_statements(tree: ast.Module):
    """Statements that run at import time: the module body and the blocks of its
    ``if``/``try``/``with`` statements, never function or class bodies (an import
    inside a function binds a local name only)."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)) or type(node).__name__ == "TryStar":
            for name in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, name, None) or []
                for item in block:
                    stack.extend(item.body if isinstance(item, ast.ExceptHandler) else [item])


def _has_import(tree: ast.Module, statement: str) -> bool:
    wanted = ast.parse(statement).body[0]
    for node in _module_level_statements(tree):
        if isinstance(wanted, ast.Import) and isinstance(node, ast.Import):
            for want in wanted.names:
                for have in node.names:
                    bound_have = have.asname or have.name.split(".", 1)[0]
                    bound_want = want.asname or want.name.split(".", 1)[0]
                    if bound_have == bound_want and (have.name == want.name or have.name.startswith(want.name + ".") or not want.asname):
                        return True
        elif isinstance(wanted, ast.ImportFrom) and isinstance(node, ast.ImportFrom):
            if node.module == wanted.module and {(a.name, a.asname) for a in wanted.names} <= {(a.name, a.asname) for a in node.names}:
                return True
    return False


def fix_source(
    source: str, path: str, options: ScanOptions, unsafe: bool | frozenset[str] = False, rules: list | None = None
) -> FileFix:
    """Fix one file's text in memory, rescanning until nothing applicable is left.
    ``unsafe``: see :func:`is_applicable`. ``rules`` (instances) may be passed in to
    share them between files."""
    if rules is None:
        rules = [cls() for cls in select_rules(options.select, options.ignore)]
    result = FileFix(path=path, original=source, fixed=source)
    current = source
    for _ in range(MAX_PASSES):
        report = scan_source(current, path, options, rules)
        todo = [f for f in report.findings if is_applicable(f.fix, unsafe, f.code)]
        if not todo:
            break
        current, applied = apply_edits(current, [f.fix for f in todo])  # type: ignore[misc]
        if not applied:
            break
        result.applied.extend(todo[i] for i in applied)
        imports = [imp for i in applied for imp in todo[i].fix.imports]  # type: ignore[union-attr]
        if imports:
            # Added now, not after the last pass, so the next pass resolves the
            # names the new code uses.
            try:
                current = add_imports(current, imports)
            except SyntaxError:
                break  # reported below
    try:
        ast.parse(current)
    except SyntaxError as exc:
        result.error = f"the fixed file would not parse (line {exc.lineno}: {exc.msg}); left untouched"
        return result
    result.fixed = current
    final = scan_source(current, path, options, rules)
    result.remaining = final.findings
    return result


def fix_paths(
    paths: list[str | Path],
    options: ScanOptions,
    *,
    unsafe: bool | frozenset[str] = False,
    write: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> FixResult:
    """Fix every file under ``paths``; with ``write=False`` only compute the fixes."""
    rules = [cls() for cls in select_rules(options.select, options.ignore)]
    options = options.with_capabilities()
    fileset = discover(paths, options.exclude)
    result = FixResult(diagnostics=list(fileset.diagnostics))
    total = len(fileset.files)
    for n, path in enumerate(fileset.files, 1):
        shown = display_path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            result.diagnostics.append(Diagnostic("AX903", f"cannot read: {exc.strerror or exc}", shown))
            continue
        # As the scan reads them: a file that never says "torch" only by the rules
        # that read such files.
        file_rules = rules if b"torch" in data else [r for r in rules if r.reads_files_without_torch]
        if file_rules:
            try:
                source = decode_source(data)
            except (UnicodeDecodeError, LookupError):
                result.diagnostics.append(Diagnostic("AX902", "not valid UTF-8 (nor its declared encoding)", shown))
                continue
            try:
                ast.parse(source)
            except (SyntaxError, ValueError) as exc:
                result.diagnostics.append(Diagnostic("AX901", parse_failure(exc), shown,
                                                     getattr(exc, "lineno", None)))
                continue
            ff = fix_source(source, shown, options, unsafe, file_rules)
            if ff.error:
                result.diagnostics.append(Diagnostic("AX908", ff.error, shown))
            elif ff.changed and write:
                if not path.stat().st_mode & 0o222:
                    # A rename over it would succeed (the folder is writable): the file's
                    # own permission says the user does not want it changed.
                    result.diagnostics.append(Diagnostic("AX909", "read-only file: left unchanged (make it "
                                                         "writable to fix it)", shown))
                    continue
                try:
                    write_text_atomic(path, ff.fixed, _encoding_of(data))
                except OSError as exc:
                    raise TorchaxeError(f"cannot write {shown}: {exc.strerror or exc}") from None
            result.files.append(ff)
        if progress:
            progress(n, total)
    return result


def _encoding_of(data: bytes) -> str:
    if data.startswith(b"\xef\xbb\xbf"):
        return "utf-8-sig"
    from torchaxe.scan.engine import CODING_LINE

    for line in data.split(b"\n", 2)[:2]:
        m = CODING_LINE.match(line)
        if m:
            return m.group(1).decode("ascii")
    return "utf-8"
