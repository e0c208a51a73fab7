"""The scan engine: read each file, skip those that never mention torch, parse once,
walk the tree once dispatching nodes to the rules that asked for them, honour
``# noqa``, and turn every problem with a file into a diagnostic."""

from __future__ import annotations

import ast
import multiprocessing
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from torchaxe.findings import Diagnostic, Finding, ScanResult
from torchaxe.cpulist import usable_cpus
from torchaxe.scan.capabilities import torch_capabilities
from torchaxe.scan.context import FileContext, Need, preorder
from torchaxe.scan.discover import discover
from torchaxe.scan.formulas.store import file_key, unneeded_key
from torchaxe.scan.formulas import remote
from torchaxe.scan.rules import Rule, select_rules

_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Za-z]+[0-9]+(?:\s*,\s*[A-Za-z]+[0-9]+)*))?", re.IGNORECASE)
#: A PEP 263 coding line (``# -*- coding: latin-1 -*-``); its group is the encoding.
CODING_LINE = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")

#: Files per task sent to a worker process; large enough to amortise the round trip.
_CHUNK = 48
#: Below this many bytes of source, a scan whose formula results are all stored runs
#: in this process whatever --jobs says: starting workers (each opening the result
#: store afresh) costs more than the rules' work they would share (81 files of
#: torch's own, 2.5 MB: 0.7 s in this process, 1.3 s with two workers, on 2 cores).
WARM_IN_PROCESS_BYTES = 4 << 20


@dataclass(frozen=True)
class ScanOptions:
    """What to scan for. Plain data, so it can be sent to worker processes."""

    target: str = "cpu"
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    jobs: int = 0  # 0: choose from the number of files and cores
    capabilities: dict[str, Any] = field(default_factory=dict)

    def with_capabilities(self) -> ScanOptions:
        if self.capabilities:
            return self
        return ScanOptions(
            self.target, self.select, self.ignore, self.exclude, self.jobs, torch_capabilities(self.target)
        )


@dataclass
class FileReport:
    path: str
    findings: list[Finding] = field(default_factory=list)
    diagnostics: list[Diagnostic] = field(default_factory=list)
    skipped: bool = False
    #: See :attr:`FileContext.facts` and :attr:`FileContext.pending`.
    facts: dict[str, list[str]] = field(default_factory=dict)
    pending: list[tuple[str, Finding]] = field(default_factory=list)
    #: See :attr:`FileContext.exports`, :attr:`FileContext.uses` and :attr:`FileContext.needs`.
    exports: dict[str, list[str]] = field(default_factory=dict)
    uses: dict[str, list[tuple[str, int, str]]] = field(default_factory=dict)
    needs: list[tuple[tuple[Need, ...], Finding]] = field(default_factory=list)
    #: When the selected formula rules never asked for the file's formula matches: the
    #: store key that says so (see :func:`all_stored`), stored once the scan ends.
    unneeded: str | None = None


#: ``async=`` in a call: PyTorch before 0.4 spelled ``non_blocking`` so, and Python 3.7
#: made ``async`` a keyword: such a file no longer parses.
_ASYNC_KEYWORD = re.compile(r"[(,]\s*async\s*=")


def parse_failure(exc: SyntaxError | ValueError) -> str:
    """The AX901 message for a file Python cannot parse, with what old PyTorch code
    needs where the cause is known (``.cuda(async=True)``)."""
    text = f"cannot parse: {getattr(exc, 'msg', exc)}"
    if isinstance(exc, SyntaxError) and exc.text and _ASYNC_KEYWORD.search(exc.text):
        text += (" (`async` is a keyword since Python 3.7: PyTorch's `async=True` argument is now "
                 "`non_blocking=True`)")
    return text


def display_path(path: Path) -> str:
    """Paths under the working folder are shown relative to it, others absolute."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())
    except OSError:
        return str(path)


def decode_source(data: bytes) -> str:
    """Decode Python source as the interpreter would: UTF-8 (BOM allowed) unless a
    PEP 263 coding line in the first two lines says otherwise.
    Raises UnicodeDecodeError or LookupError when it cannot."""
    for line in data.split(b"\n", 2)[:2]:
        m = CODING_LINE.match(line)
        if m:
            return data.decode(m.group(1).decode("ascii"))
    return data.decode("utf-8-sig")


class _Dispatcher:
    """Rules grouped by node type for one pass over the tree."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules = list(rules)
        self.by_type: dict[type, list[Rule]] = {}
        for rule in self.rules:
            for node_type in rule.node_types:
                self.by_type.setdefault(node_type, []).append(rule)


class _WordFinder:
    """Which of the rules' prefilter words a file's text holds, found in one pass over
    the text (an Aho-Corasick automaton over every word) instead of one substring
    search per word: most files hold none of most rules' words, so searching word by
    word read each file about a hundred times (4.4 s of a 15 s scan of torch's tree)."""

    def __init__(self, words: Iterable[str]) -> None:
        self.words = frozenset(w for w in words if w)
        self.automaton: Any = None
        if not self.words:
            return
        try:
            import ahocorasick
        except ImportError:  # word by word, as before (slower, same answers)
            return
        automaton = ahocorasick.Automaton()
        for word in self.words:
            automaton.add_word(word, word)
        automaton.make_automaton()
        self.automaton = automaton

    def finder(self, source: str) -> Callable[[str], bool]:
        """``word -> whether source holds it``, for this finder's words."""
        if self.automaton is None:
            memo: dict[str, bool] = {}

            def holds(word: str) -> bool:
                found = memo.get(word)
                if found is None:
                    found = memo[word] = word in source
                return found

            return holds
        present = {word for _, word in self.automaton.iter(source)}
        return present.__contains__


#: One finder per set of rule classes (a scan uses one; workers build their own).
_FINDERS: dict[tuple[type, ...], _WordFinder] = {}


def _finder(rules: list[Rule], source: str) -> Callable[[str], bool]:
    key = tuple(type(rule) for rule in rules)
    found = _FINDERS.get(key)
    if found is None:
        words: set[str] = set()
        for rule in rules:
            words.update(rule.requires_text, rule.also_requires_text, rule.sufficient_text, rule.export_text)
        found = _FINDERS[key] = _WordFinder(words)
    return found.finder(source)


def _applicable(rules: list[Rule], source: str, target: str,
                holds: Callable[[str], bool] | None = None) -> list[Rule]:
    """The rules whose prefilters a file's text passes. ``holds``: a
    :meth:`_WordFinder.finder` of the text, when the caller has one."""
    if holds is None:
        holds = _finder(rules, source)

    def has(words: tuple[str, ...]) -> bool:
        for word in words:
            if holds(word):
                return True
        return False

    return [
        r
        for r in rules
        if target in r.targets
        and ((r.sufficient_text and has(r.sufficient_text)) or (
            (not r.requires_text or has(r.requires_text))
            and (not r.also_requires_text or has(r.also_requires_text))
            and (r.requires_pattern is None or r.requires_pattern.search(source))))
    ]


def scan_source(
    source: str,
    path: str,
    options: ScanOptions,
    rules: Iterable[Rule] | None = None,
) -> FileReport:
    """Scan one file's text. Never raises for bad input: problems become diagnostics."""
    report = FileReport(path)
    if rules is None:
        rules = [cls() for cls in select_rules(options.select, options.ignore)]
    rules = list(rules)
    holds = _finder(rules, source)
    active = _applicable(rules, source, options.target, holds)
    exporters = [r for r in rules if r.export_text and options.target in r.targets
                 and any(holds(word) for word in r.export_text)]
    formula_codes = sorted(r.code for r in rules if r.uses_formulas)
    if not active and not exporters:
        # Nothing any selected rule looks for: not worth parsing (counted as skipped).
        report.skipped = True
        report.unneeded = _unneeded(source, options.target, formula_codes)
        return report
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        report.diagnostics.append(Diagnostic("AX901", parse_failure(exc), path, exc.lineno))
        return report
    except (ValueError, RecursionError, MemoryError) as exc:
        report.diagnostics.append(Diagnostic("AX901", f"cannot parse: {type(exc).__name__}", path))
        return report
    ctx = FileContext(path=path, source=source, tree=tree, target=options.target, capabilities=options.capabilities)
    dispatcher = _Dispatcher(active)
    findings: list[Finding] = []
    try:
        if dispatcher.by_type:
            _walk(tree, ctx, dispatcher.by_type, findings, report)
        for rule in active:
            _run(rule, lambda r=rule: r.check_module(ctx), findings, report, path)
        for rule in exporters:
            _run(rule, lambda r=rule: r.export(ctx), findings, report, path)
        if formula_codes and not _analysed(ctx):
            report.unneeded = _unneeded(source, options.target, formula_codes)
    except RecursionError:
        report.diagnostics.append(Diagnostic("AX907", "file nested too deeply to analyse", path))
    report.findings = _drop_noqa(findings, ctx.lines)
    report.facts = ctx.facts
    kept = set(map(id, _drop_noqa([f for _, f in ctx.pending], ctx.lines)))
    report.pending = [(fact, f) for fact, f in ctx.pending if id(f) in kept]
    report.exports, report.uses = ctx.exports, ctx.uses
    kept = set(map(id, _drop_noqa([f for _, f in ctx.needs], ctx.lines)))
    report.needs = [(needs, f) for needs, f in ctx.needs if id(f) in kept]
    return report


def _run(rule: Rule, call: Callable[[], Iterable[Finding]], out: list[Finding], report: FileReport, path: str) -> None:
    try:
        out.extend(call() or ())
    except RecursionError:
        raise
    except Exception as exc:  # a bug in one rule must not stop the scan
        _rule_failed(rule, exc, report, path)


def _rule_failed(rule: Rule, exc: Exception, report: FileReport, path: str) -> None:
    report.diagnostics.append(Diagnostic("AX906", f"rule {rule.code} failed: {type(exc).__name__}: {exc}", path))


def _walk(tree: ast.AST, ctx: FileContext, by_type: dict[type, list[Rule]], out: list[Finding], report: FileReport) -> None:
    """One depth-first pass in source order, keeping ``ctx.parents`` current and
    calling each rule registered for the node's type. The same walk indexes the
    file's nodes for :meth:`FileContext.nodes`."""
    order, depths = preorder(tree)
    ctx.index_nodes(order, depths)
    parents = ctx.parents
    for node, depth in zip(order, depths):
        del parents[depth:]
        rules = by_type.get(type(node))
        if rules:
            for rule in rules:
                try:
                    found = rule.visit(node, ctx)
                    if found:
                        out.extend(found)
                except RecursionError:
                    raise
                except Exception as exc:  # a bug in one rule must not stop the scan
                    _rule_failed(rule, exc, report, ctx.path)
        parents.append(node)
    parents.clear()


def _drop_noqa(findings: list[Finding], lines: list[str]) -> list[Finding]:
    kept = []
    for f in findings:
        if not _silenced(f, lines):
            kept.append(f)
    return kept


def _silenced(f: Finding, lines: list[str]) -> bool:
    for lineno in {f.line, f.end_line}:
        if 0 < lineno <= len(lines) and "noqa" in lines[lineno - 1].lower():
            m = _NOQA.search(lines[lineno - 1])
            if m is None:
                continue
            codes = m.group("codes")
            if not codes:
                return True
            if any(f.code.upper().startswith(c.strip().upper()) for c in codes.split(",")):
                return True
    return False


def scan_file(path: Path, options: ScanOptions, rules: list[Rule], data: bytes | None = None) -> FileReport:
    """One file's report; ``data``: its bytes, when read already."""
    shown = display_path(path)
    try:
        if data is None:
            data = path.read_bytes()
    except FileNotFoundError:
        return FileReport(shown, diagnostics=[Diagnostic("AX904", "file vanished during the scan", shown)])
    except IsADirectoryError:
        return FileReport(shown, diagnostics=[Diagnostic("AX903", "is a folder, not a file", shown)])
    except OSError as exc:
        return FileReport(shown, diagnostics=[Diagnostic("AX903", f"cannot read: {exc.strerror or exc}", shown)])
    if b"torch" not in data:
        # Only the rules that read such files (a helper module of the project that
        # averages the tensors handed to it never needs to import torch).
        rules = [r for r in rules if r.reads_files_without_torch]
        if not rules:
            return FileReport(shown, skipped=True)
    try:
        source = decode_source(data)
    except (UnicodeDecodeError, LookupError):
        return FileReport(shown, diagnostics=[Diagnostic("AX902", "not valid UTF-8 (nor its declared encoding)", shown)])
    return scan_source(source, shown, options, rules)


def all_stored(sources: Iterable[str], target: str, codes: list[str]) -> bool:
    """Whether every one of these files is known to need no formula evaluation from the
    formula rules ``codes``: its formula results are stored, or a scan with those rules
    found that none of them asked for them (most files: no formula rule's words, or
    AX103's definitions that do no math). Scanning them then evaluates nothing and
    needs no torch. Stops at the first that is neither: a cold scan reads one file."""
    from torchaxe.scan.formulas import analysis

    return all(analysis.STORE.get_many([file_key(source, target), unneeded_key(source, target, codes)])
               for source in sources)


def _analysed(ctx: FileContext) -> bool:
    from torchaxe.scan.formulas.analysis import analysed

    return analysed(ctx)


def _unneeded(source: str, target: str, codes: list[str]) -> str | None:
    return unneeded_key(source, target, codes) if codes else None


def _store_unneeded(reports: list[FileReport]) -> None:
    """Store, in one write, the files whose formula rules asked nothing (see
    :func:`all_stored`)."""
    keys = {r.unneeded: [] for r in reports if r.unneeded}
    if keys:
        from torchaxe.scan.formulas import analysis

        analysis.STORE.put_many(keys)


def _torch_sources(files: list[str], keep: dict[str, bytes] | None = None) -> Iterator[str]:
    """The text of the files the scan will analyse (those that mention torch), read one
    at a time as asked for; a file that cannot be read or decoded is left to the scan
    to report. ``keep``: where to leave each file's bytes, for the scan to reuse."""
    for p in files:
        try:
            data = Path(p).read_bytes()
            if keep is not None:
                keep[p] = data
            source = decode_source(data) if b"torch" in data else None
        except (OSError, UnicodeDecodeError, LookupError):
            continue
        if source is not None:
            yield source


def _source_bytes(files: list[str]) -> int:
    """The files' total size (a file that cannot be read counts nothing: the scan reports it)."""
    total = 0
    for p in files:
        try:
            total += os.stat(p).st_size
        except OSError:
            continue
    return total


def _scan_chunk(paths: list[str], options: ScanOptions) -> list[FileReport]:
    rules = [cls() for cls in select_rules(options.select, options.ignore)]
    return [scan_file(Path(p), options, rules) for p in paths]


def balanced_chunks(files: list[str], jobs: int) -> list[list[str]]:
    """The files cut into tasks for ``jobs`` workers: neighbouring files, at most
    ``_CHUNK`` of them and about an eighth of a worker's share of the bytes per task,
    the largest tasks first. A tree's few very large files sit side by side (torch's
    test suites); cut by count alone, one worker scanned them all while the others
    sat idle at the end."""
    sizes = []
    for p in files:
        try:
            sizes.append(os.stat(p).st_size)
        except OSError:
            sizes.append(0)
    share = max(1, sum(sizes) // (jobs * 8))
    chunks: list[tuple[int, list[str]]] = []
    current: list[str] = []
    weight = 0
    for path, size in zip(files, sizes):
        if current and (len(current) >= _CHUNK or weight + size > share):
            chunks.append((weight, current))
            current, weight = [], 0
        current.append(path)
        weight += size
    if current:
        chunks.append((weight, current))
    chunks.sort(key=lambda c: -c[0])
    return [c for _, c in chunks]


def _job_count(requested: int, files: int) -> int:
    if requested > 0:
        return requested
    return max(1, min(usable_cpus(), files // (_CHUNK * 2)))


def _module_stem(path: Path) -> str:
    return path.parent.name if path.name == "__init__.py" else path.stem


def _held(report: FileReport, reports: list[FileReport]) -> list[Finding]:
    """The pending findings of ``report`` that hold: a scanned file with the property
    they need, in the same folder as this one or above it, imports this file's
    module (``main.py`` builds DDP and imports ``engine``: ``engine.py``'s
    accumulation loop runs under DDP)."""
    if not report.pending:
        return []
    here = Path(report.path).resolve()
    stem = _module_stem(here)
    held = []
    for fact, finding in report.pending:
        for other in reports:
            names = other.facts.get(fact)
            if names and stem in names and other is not report \
                    and Path(other.path).resolve().parent in (here.parent, *here.parents):
                held.append(finding)
                break
    return held


class _Modules:
    """The scanned files, found by the module names other files import them by."""

    def __init__(self, reports: list[FileReport]) -> None:
        self.paths: dict[Path, FileReport] = {}
        self.by_stem: dict[str, list[Path]] = {}
        for rep in reports:
            if rep.skipped:
                continue
            path = Path(rep.path).resolve()
            self.paths[path] = rep
            self.by_stem.setdefault(_module_stem(path), []).append(path)

    def resolve(self, importer: Path, module: str, level: int) -> list[Path]:
        """The scanned files ``module`` names when ``importer`` imports it (``level``
        dots up for a relative import): its own file; or, for a package whose
        ``__init__.py`` was not scanned (nothing of torch in it: it re-exports), the
        files of the package's folder. For an absolute name, the match nearest the
        importer (a project's ``model.py`` beside its ``train.py``, not another's)."""
        parts = [p for p in module.split(".") if p]
        if level:
            base = importer.parent
            for _ in range(level - 1):
                base = base.parent
            folder = base.joinpath(*parts)
            if parts and folder.with_suffix(".py") in self.paths:
                return [folder.with_suffix(".py")]
            return [p for p in self.paths if p.parent == folder and p != importer]
        if not parts:
            return []
        tail = tuple(parts)
        files = [p for p in self.by_stem.get(parts[-1], ())
                 if (p.parent.parts if p.name == "__init__.py" else p.with_suffix("").parts)[-len(tail):] == tail
                 and p != importer]
        folders = {p.parent for p in self.paths if p.parent.parts[-len(tail):] == tail}
        options = [(self._nearness(p, importer), [p]) for p in files]
        options += [(self._nearness(f / "__init__.py", importer), [p for p in self.paths if p.parent == f and p != importer])
                    for f in folders]
        return max(options, key=lambda o: o[0])[1] if options else []

    @staticmethod
    def _nearness(path: Path, importer: Path) -> tuple[int, int]:
        return len(os.path.commonpath([path, importer]).split(os.sep)), -len(path.parts)

    def holds(self, report: FileReport, need: Need) -> bool:
        here = Path(report.path).resolve()
        if need.kind == "exports":
            return any(need.name in self.paths[there].exports.get(need.fact, ())
                       for there in self.resolve(here, need.module, need.level))
        for path, other in self.paths.items():
            for module, level, name in other.uses.get(need.fact, ()):
                if name == need.name and path != here and here in self.resolve(path, module, level):
                    return True
        return False


def _needed(reports: list[FileReport]) -> None:
    """Add to each report the findings whose needs of other files hold."""
    if not any(rep.needs for rep in reports):
        return
    modules = _Modules(reports)
    for rep in reports:
        for needs, finding in rep.needs:
            if all(modules.holds(rep, need) for need in needs):
                rep.findings.append(finding)


def scan_paths(
    paths: list[str | Path],
    options: ScanOptions,
    progress: Callable[[int, int], None] | None = None,
) -> ScanResult:
    """Scan files and folders; ``progress(done, total)`` is called as files finish."""
    started = time.perf_counter()
    select_rules(options.select, options.ignore)  # bad prefixes fail before any work
    options = options.with_capabilities()
    fileset = discover(paths, options.exclude)
    result = ScanResult(target=options.target, diagnostics=list(fileset.diagnostics))
    files = [str(p) for p in fileset.files]
    total = len(files)
    jobs = _job_count(options.jobs, total)
    reports: list[FileReport] = []
    rules = [cls() for cls in select_rules(options.select, options.ignore)]
    needs_evaluator = False
    read: dict[str, bytes] = {}  # files' bytes read to see whether the formula results are stored
    if jobs > 1 and total > _CHUNK:
        # Formula rules evaluate candidate trees with torch: one evaluator process
        # imports it once for all workers, and only if some file needs it. When
        # every file's results are stored already, none is started, and a small
        # scan stays in this process.
        formula_rules = [r for r in rules if r.uses_formulas]
        small = _source_bytes(files) < WARM_IN_PROCESS_BYTES
        needs_evaluator = bool(formula_rules) and not all_stored(
            _torch_sources(files, read if small else None), options.target,
            sorted(r.code for r in formula_rules))
        if not needs_evaluator and small:
            jobs = 1  # scanned here, from the bytes just read
    if jobs <= 1 or total <= _CHUNK:
        for i, p in enumerate(files, 1):
            reports.append(scan_file(Path(p), options, rules, read.pop(p, None)))
            if progress:
                progress(i, total)
    else:
        read.clear()  # the workers read their own files
        chunks = balanced_chunks(files, jobs)
        done = 0
        context = multiprocessing.get_context()
        evaluator = remote.Evaluator(context, jobs, eager=True) if needs_evaluator else None
        try:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=context,
                                     initializer=remote.connect if evaluator else None,
                                     initargs=evaluator.worker_args() if evaluator else ()) as pool:
                for chunk_reports in pool.map(_scan_chunk, chunks, [options] * len(chunks)):
                    reports.extend(chunk_reports)
                    done += len(chunk_reports)
                    if progress:
                        progress(done, total)
        finally:
            if evaluator is not None:
                evaluator.close()
    _store_unneeded(reports)
    _needed(reports)
    for rep in reports:
        rep.findings.extend(_held(rep, reports))
        if rep.skipped:
            result.stats.files_skipped += 1
        else:
            result.stats.files_scanned += 1
        result.findings.extend(rep.findings)
        result.diagnostics.extend(rep.diagnostics)
    result.findings.sort(key=lambda f: f.sort_key)
    result.diagnostics.sort(key=lambda d: (d.path, d.line or 0, d.code))
    result.stats.seconds = time.perf_counter() - started
    return result
