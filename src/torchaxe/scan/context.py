"""What a rule sees of one file: its source, its syntax tree, the names its imports
bind, the ancestors of the node being visited, and helpers to build findings and edits.

Nothing here imports or runs the scanned code.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from torchaxe.findings import Applicability, Edit, Finding, Fix, Position

if TYPE_CHECKING:
    from torchaxe.scan.rules.base import Rule

LOOP_TYPES = (ast.For, ast.AsyncFor, ast.While)
DEFINITION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
SCOPE_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.Module)


@dataclass
class FileContext:
    """One parsed file, shared by every rule that looks at it."""

    path: str
    source: str
    tree: ast.Module
    target: str
    #: Facts about the installed torch, computed once per scan (see ``capabilities``).
    capabilities: dict[str, Any] = field(default_factory=dict)
    #: Ancestors of the node being visited, outermost first; kept by the engine.
    parents: list[ast.AST] = field(default_factory=list)
    #: Per-file memo for rules (keyed by whatever the rule likes).
    cache: dict[Any, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lines = self.source.splitlines(keepends=True)
        self._line_starts: list[int] | None = None
        self.imports = _collect_imports(self.tree)

    # ---------------------------------------------------------------- names
    def qualified_name(self, node: ast.AST) -> str | None:
        """The dotted name an expression refers to, through import aliases.

        ``optim.AdamW`` after ``import torch.optim as optim`` is ``torch.optim.AdamW``;
        ``A`` after ``from torch.optim import AdamW as A`` is ``torch.optim.AdamW``.
        Names that no import binds resolve to ``None``.
        """
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        base = self.imports.get(node.id)
        if base is None:
            return None
        parts.append(base)
        return ".".join(reversed(parts))

    def call_name(self, call: ast.Call) -> str | None:
        return self.qualified_name(call.func)

    # ------------------------------------------------------------- positions
    def _col(self, lineno: int, byte_col: int) -> int:
        """Convert an ``ast`` UTF-8 byte offset to a 1-based character column."""
        if lineno - 1 >= len(self.lines):
            return byte_col + 1
        text = self.lines[lineno - 1]
        if text.isascii():
            return byte_col + 1
        return len(text.encode("utf-8")[:byte_col].decode("utf-8", errors="replace")) + 1

    def start(self, node: ast.AST) -> Position:
        return Position(node.lineno, self._col(node.lineno, node.col_offset))  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> Position:
        line = node.end_lineno or node.lineno  # type: ignore[attr-defined]
        return Position(line, self._col(line, node.end_col_offset or 0))  # type: ignore[attr-defined]

    def offset(self, pos: Position) -> int:
        """Absolute character offset of a position in ``source``."""
        if self._line_starts is None:
            starts, total = [], 0
            for text in self.lines:
                starts.append(total)
                total += len(text)
            starts.append(total)
            self._line_starts = starts
        line = min(pos.line - 1, len(self._line_starts) - 1)
        return self._line_starts[line] + pos.col - 1

    def text(self, node: ast.AST) -> str:
        return self.source[self.offset(self.start(node)) : self.offset(self.end(node))]

    def snippet(self, node: ast.AST) -> str:
        """The source lines the node spans, without the trailing newline."""
        first = node.lineno  # type: ignore[attr-defined]
        last = node.end_lineno or first  # type: ignore[attr-defined]
        return "".join(self.lines[first - 1 : last]).rstrip("\r\n")

    # ------------------------------------------------------------- findings
    def finding(
        self,
        rule: Rule,
        node: ast.AST,
        message: str | None = None,
        *,
        replacement: str | None = None,
        fix: Fix | None = None,
    ) -> Finding:
        start, end = self.start(node), self.end(node)
        snippet = None
        if isinstance(node, DEFINITION_TYPES):
            # A definition is reported on its header line, not over its whole body.
            header = self.lines[node.lineno - 1].rstrip("\r\n")
            end = Position(node.lineno, len(header) + 1)
            snippet = header
        return Finding(
            code=rule.code,
            category=rule.category,
            message=message or rule.message,
            path=self.path,
            line=start.line,
            col=start.col,
            end_line=end.line,
            end_col=end.col,
            snippet=snippet if snippet is not None else self.snippet(node),
            target=self.target,
            replacement=replacement,
            fix=fix,
            references=tuple(rule.references),
        )

    def fix(
        self,
        rule: Rule,
        edits: list[Edit] | tuple[Edit, ...],
        *,
        imports: tuple[str, ...] = (),
        applicability: Applicability | None = None,
        title: str | None = None,
    ) -> Fix:
        return Fix(
            applicability=applicability or rule.fix_safety or Applicability.DISPLAY_ONLY,
            title=title or rule.fix_title or "",
            edits=tuple(edits),
            imports=imports,
        )

    # ------------------------------------------------------------ edits
    def replace(self, node: ast.AST, content: str) -> Edit:
        return Edit(self.start(node), self.end(node), content)

    def add_keyword(self, call: ast.Call, keyword_text: str) -> Edit:
        """An edit that appends ``name=value`` to a call's arguments, keeping the
        call's own layout (trailing comma, closing parenthesis on its own line)."""
        end = self.end(call)
        close = self.offset(end) - 1  # the closing parenthesis
        args: list[ast.AST] = [*call.args, *call.keywords]
        if not args:
            pos = self._position_of(close)
            return Edit(pos, pos, keyword_text)
        last_end = max(self.offset(self.end(a)) for a in args)
        between = self.source[last_end:close]
        if "," in between:
            # Trailing comma: put the new argument after it, on the same line as the
            # last argument when the call closes on that line, else on a new line.
            comma = last_end + between.index(",") + 1
            if "\n" in between:
                indent = self._indent_of(self.start(args[-1]).line)
                pos = self._position_of(comma)
                return Edit(pos, pos, f"\n{indent}{keyword_text},")
            pos = self._position_of(comma)
            return Edit(pos, pos, f" {keyword_text},")
        pos = self._position_of(last_end)
        return Edit(pos, pos, f", {keyword_text}")

    def remove_keyword(self, call: ast.Call, keyword: ast.keyword) -> Edit:
        """An edit that deletes one keyword argument and the comma that joins it."""
        args: list[ast.AST] = [*call.args, *call.keywords]
        args.sort(key=lambda a: (a.lineno, a.col_offset))  # type: ignore[attr-defined]
        index = args.index(keyword)
        if index > 0:
            start = self.offset(self.end(args[index - 1]))
            end = self.offset(self.end(keyword))
        elif len(args) > 1:
            start = self.offset(self.start(keyword))
            end = self.offset(self.start(args[1]))
        else:
            start = self.offset(self.start(keyword))
            end = self.offset(self.end(call)) - 1
            between = self.source[self.offset(self.end(keyword)) : end]
            if between.strip() not in ("", ","):
                end = self.offset(self.end(keyword))
        return Edit(self._position_of(start), self._position_of(end), "")

    def _position_of(self, offset: int) -> Position:
        self.offset(Position(1, 1))  # make sure line starts exist
        assert self._line_starts is not None
        lo, hi = 0, len(self._line_starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._line_starts[mid] <= offset:
                lo = mid
            else:
                hi = mid - 1
        return Position(lo + 1, offset - self._line_starts[lo] + 1)

    def _indent_of(self, line: int) -> str:
        text = self.lines[line - 1]
        return text[: len(text) - len(text.lstrip())]

    # ------------------------------------------------------------ structure
    def enclosing(self, types: type | tuple[type, ...]) -> ast.AST | None:
        """The innermost ancestor of the current node of the given type(s)."""
        for node in reversed(self.parents):
            if isinstance(node, types):
                return node
        return None

    def enclosing_training_loop(self) -> ast.AST | None:
        """The innermost loop around the current node, within the same function,
        whose body runs a backward pass or an optimizer step."""
        for node in reversed(self.parents):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                return None
            if isinstance(node, LOOP_TYPES) and self.is_training_loop(node):
                return node
        return None

    def is_training_loop(self, loop: ast.AST) -> bool:
        key = ("training_loop", id(loop))
        if key not in self.cache:
            self.cache[key] = any(self._is_training_call(n) for n in _walk_same_scope(loop))
        return self.cache[key]

    def _is_training_call(self, node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        func = node.func
        if isinstance(func, ast.Attribute):
            if func.attr == "backward":
                return True
            if func.attr == "step":
                receiver = func.value
                if isinstance(receiver, ast.Attribute):
                    receiver_name = receiver.attr
                elif isinstance(receiver, ast.Name):
                    receiver_name = receiver.id
                else:
                    return False
                return "opt" in receiver_name.lower() or receiver_name in self.optimizer_names()
        return self.qualified_name(func) == "torch.autograd.backward"

    def optimizer_names(self) -> frozenset[str]:
        """Names assigned from a ``torch.optim`` (or torch_npu/apex) optimizer."""
        key = "optimizer_names"
        if key not in self.cache:
            names = set()
            for node in ast.walk(self.tree):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    qn = self.call_name(node.value) or ""
                    if _is_optimizer_name(qn):
                        for t in node.targets:
                            if isinstance(t, ast.Name):
                                names.add(t.id)
                            elif isinstance(t, ast.Attribute):
                                names.add(t.attr)
            self.cache[key] = frozenset(names)
        return self.cache[key]


def _is_optimizer_name(qualified: str) -> bool:
    return qualified.startswith(("torch.optim.", "torch_npu.optim.", "apex.optimizers.")) and (
        qualified.rsplit(".", 1)[-1][:1].isupper()
    )


def _walk_same_scope(node: ast.AST) -> Iterator[ast.AST]:
    """Walk a subtree without entering nested functions, lambdas or classes."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(child))


def _collect_imports(tree: ast.Module) -> dict[str, str]:
    """Map each name bound by an import anywhere in the file to its dotted origin.

    ``import torch.nn.functional`` binds ``torch`` (to ``torch``); aliases bind the
    full path. Relative imports are skipped: they are the user's own code.
    """
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".", 1)[0]
                    names[head] = head
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if alias.name == "*":
                    continue
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names
