"""What a rule sees of one file: its source, its syntax tree, the names its imports
bind, the ancestors of the node being visited, and helpers to build findings and edits.

Nothing here imports or runs the scanned code.
"""

from __future__ import annotations

import ast
import bisect
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from torchaxe.findings import Applicability, Edit, Finding, Fix, Position

if TYPE_CHECKING:
    from torchaxe.scan.rules.base import Rule

LOOP_TYPES = (ast.For, ast.AsyncFor, ast.While)
DEFINITION_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
#: Nodes whose bodies run at another time than the code around them.
BOUNDARY_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True)
class Need:
    """What a finding of one file needs of another to hold (see :attr:`FileContext.needs`).

    ``kind == "exports"``: the module ``module`` (imported ``level`` dots up, as the
    file's import statement wrote it) is a scanned file whose ``exports[fact]`` holds
    ``name`` (train.py's criterion on ``Discriminator(...)``'s output holds when
    dcgan.py's ``Discriminator`` ends in a sigmoid). ``kind == "used"``: some scanned
    file's ``uses[fact]`` names ``name`` of this file (dcgan.py's sigmoid holds when
    a training script applies binary cross-entropy to its output); ``module`` and
    ``level`` are unused."""

    kind: str
    fact: str
    name: str
    module: str = ""
    level: int = 0


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
    #: What this file tells the rules about other files: a property of the file (a
    #: rule's word, e.g. ``"distributed"``) -> the module names it imports (see
    #: :func:`imported_module_names`). Gathered over the whole scan.
    facts: dict[str, list[str]] = field(default_factory=dict)
    #: Findings that hold only if a scanned file with a property imports this one:
    #: (property, finding). The scan keeps them when one does (engine.py).
    pending: list[tuple[str, Finding]] = field(default_factory=list)
    #: Names this file defines that have a property (a rule's word, e.g.
    #: ``"sigmoid-models"`` -> ``["Discriminator"]``), for other files' findings.
    exports: dict[str, list[str]] = field(default_factory=dict)
    #: What this file does with names of other files (a rule's word -> ``(module,
    #: level, name)`` as :meth:`imported_from` gives them), for their findings.
    uses: dict[str, list[tuple[str, int, str]]] = field(default_factory=dict)
    #: Findings that hold only when other scanned files say so (see :class:`Need`;
    #: every need of a finding must hold). The scan keeps them when they do (engine.py).
    needs: list[tuple[tuple[Need, ...], Finding]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lines = self.source.splitlines(keepends=True)
        self._line_starts: list[int] | None = None
        self.imports = _collect_imports(self.tree)
        self._origins: dict[str, tuple[str, int, str | None]] | None = None

    def imported_from(self, node: ast.AST) -> tuple[str, int, str] | None:
        """``(module, level, name)`` when ``node`` names something another module
        defines, by this file's imports: ``Discriminator`` after ``from dcgan import
        Discriminator`` is ``("dcgan", 0, "Discriminator")``; ``commons.clip_grad_value_``
        after ``import commons`` is ``("commons", 0, "clip_grad_value_")``; ``net.D``
        after ``from . import net`` is ``("net", 1, "D")``. Whether that module is a
        file of the project is the engine's to find out. None otherwise."""
        if self._origins is None:
            self._origins = _collect_origins(self.nodes(ast.Import, ast.ImportFrom))
        split = _attribute_chain(node)
        origin = self._origins.get(split[0]) if split is not None else None
        if origin is None:
            return None
        module, level, name = origin
        chain = ([name] if name is not None else []) + split[1]  # type: ignore[index]
        if not chain:
            return None
        dotted = ".".join(p for p in (module, *chain[:-1]) if p)
        return dotted, level, chain[-1]

    # ---------------------------------------------------------------- nodes
    def nodes(self, *types: type) -> list[Any]:
        """Every node of the file in :func:`ast.walk`'s order, or only those of
        ``types``; the tree is walked once per file for all rules (walking it again
        in each rule was most of a scan's time on large files)."""
        index = self.cache.get("nodes")
        if index is None:
            self.index_nodes(*preorder(self.tree))
            index = self.cache["nodes"]
        if not types:
            return index[()]
        if len(types) == 1:
            return index.get(types[0], [])
        found = index.get(types)
        if found is None:
            wanted = set(types)
            found = index[types] = [n for n in index[()] if type(n) in wanted]
        return found

    def index_nodes(self, order: list[ast.AST], depths: list[int]) -> None:
        """Index the file's nodes for :meth:`nodes` from a :func:`preorder` of its tree
        (the engine's one walk), in :func:`ast.walk`'s order."""
        everything = [order[i] for i in sorted(range(len(order)), key=depths.__getitem__)]
        index: dict[Any, list[Any]] = {(): everything}
        for node in everything:
            found = index.get(type(node))
            if found is None:
                index[type(node)] = [node]
            else:
                found.append(node)
        self.cache["nodes"] = index

    # ---------------------------------------------------------------- names
    def qualified_name(self, node: ast.AST) -> str | None:
        """The dotted name an expression refers to, through import aliases.

        ``optim.AdamW`` after ``import torch.optim as optim`` is ``torch.optim.AdamW``;
        ``A`` after ``from torch.optim import AdamW as A`` is ``torch.optim.AdamW``.
        Names that no import binds resolve to ``None``.
        """
        split = _attribute_chain(node)
        base = self.imports.get(split[0]) if split is not None else None
        if base is None:
            return None
        return ".".join([base, *split[1]])  # type: ignore[index]

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

    def add_keyword(self, call: ast.Call, keyword_text: str) -> list[Edit]:
        """Edits that append ``name=value`` to a call's arguments, keeping the call's
        layout: a trailing comma, a closing parenthesis on its own line, and a
        ``# comment`` after the last argument (the new argument goes on its own line
        after the comment, never into it)."""
        end = self.end(call)
        close = self.offset(end) - 1  # the closing parenthesis
        args = self.arguments(call)
        if not args:
            pos = self._position_of(close)
            return [Edit(pos, pos, keyword_text)]
        last = args[-1]
        last_end = self.offset(self.end(last))
        between = self.source[last_end:close]
        indent = self._indent_of(self.start(last).line)
        hash_at = between.find("#")
        if hash_at >= 0:
            newline_at = between.index("\n", hash_at)  # a comment always ends its line
            insert = self._position_of(last_end + newline_at)
            edits = [Edit(insert, insert, f"\n{indent}{keyword_text},")]
            if "," not in between[:hash_at]:
                pos = self._position_of(last_end)
                edits.append(Edit(pos, pos, ","))
            return edits
        if "," in between:
            # Trailing comma: the new argument goes after it, on a new line when the
            # closing parenthesis sits on a line of its own.
            pos = self._position_of(last_end + between.index(",") + 1)
            if "\n" in between:
                return [Edit(pos, pos, f"\n{indent}{keyword_text},")]
            return [Edit(pos, pos, f" {keyword_text},")]
        pos = self._position_of(last_end)
        return [Edit(pos, pos, f", {keyword_text}")]

    def remove_argument(self, call: ast.Call, argument: ast.AST) -> Edit | None:
        """An edit that deletes one argument (positional or keyword) with the comma
        that joins it, keeping comments; ``None`` when no clean edit exists (the rule
        then offers no automatic fix)."""
        args = self.arguments(call)
        index = args.index(argument)
        start, end = self.start(argument), self.end(argument)
        close = self.offset(self.end(call)) - 1
        if len(args) == 1:
            # The only argument: empty the parentheses, unless a comment is inside
            # (then only the argument and its comma go).
            open_at = self.source.rfind("(", self.offset(self.end(call.func)), self.offset(start))
            if open_at >= 0 and "#" not in self.source[open_at:close]:
                return Edit(self._position_of(open_at + 1), self._position_of(close), "")
        if index > 0:
            before = self.end(args[index - 1])
            if "#" not in self.source[self.offset(before) : self.offset(end)]:
                return Edit(before, end, "")
        # Delete the argument and the comma after it; a line it leaves blank goes too.
        rest = self.source[self.offset(end) : close]
        stripped = rest.lstrip(" \t")
        if not stripped.startswith(","):
            return None
        after = len(rest) - len(stripped) + 1
        after += len(rest[after:]) - len(rest[after:].lstrip(" \t"))
        stop = self._position_of(self.offset(end) + after)
        alone = not self.lines[start.line - 1][: start.col - 1].strip() and rest[after:].startswith("\n")
        if alone:
            return Edit(Position(start.line, 1), Position(stop.line + 1, 1), "")
        return Edit(start, stop, "")

    @staticmethod
    def arguments(call: ast.Call) -> list[ast.AST]:
        """A call's positional and keyword arguments in source order."""
        return sorted([*call.args, *call.keywords], key=lambda a: (a.lineno, a.col_offset))  # type: ignore[attr-defined]

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
    def training_loop(self, *nodes: ast.AST) -> ast.AST | None:
        """The innermost loop, in the same function, that runs ``nodes[-1]`` (the
        visited node when ``nodes`` is empty) on every iteration and itself runs a
        training step (see :meth:`runs_training_step`).

        ``nodes`` extend ``parents`` (the visited node, then any descendant of it). A
        loop's iterable and ``else`` clause run once, so they are not inside it; a
        function, lambda or class defined in a loop is not in the loop. An evaluation
        loop nested in an epoch loop is not a training loop even though the epoch loop
        holds the training loop too: the epoch loop's own body must train.

        A step written as a function counts as a training loop's body: the function
        is returned in place of the loop (see :meth:`is_step_function`).
        """
        path = [*self.parents, *nodes]
        for i in range(len(path) - 2, -1, -1):
            parent, child = path[i], path[i + 1]
            if isinstance(parent, BOUNDARY_TYPES):
                if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and any(child is s for s in parent.body) and self.is_step_function(parent):
                    return parent
                return None
            if isinstance(parent, LOOP_TYPES) and _repeats(parent, child) and self.runs_training_step(parent):
                return parent
        return None

    def called_in_loops(self) -> frozenset[str]:
        """Names of the functions and methods the file calls on every iteration of
        some loop (``train_step(batch)``, ``self.training_step(batch)``)."""
        key = "called_in_loops"
        if key not in self.cache:
            names: set[str] = set()
            covered: set[int] = set()  # loops read with the loop around them
            for loop in self.nodes(*LOOP_TYPES):  # outer loops first
                if id(loop) in covered:
                    continue
                body: list[ast.AST] = []
                stack: list[ast.AST] = list(loop.body)
                while stack:
                    node = stack.pop()
                    body.append(node)
                    if isinstance(node, LOOP_TYPES):
                        covered.add(id(node))
                    if not isinstance(node, BOUNDARY_TYPES):
                        stack.extend(child_nodes(node))
                names |= called_names(body)
            self.cache[key] = frozenset(names)
        return self.cache[key]

    def is_step_function(self, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """Whether a function's body runs once per training step: it runs a training
        step itself (see :meth:`runs_training_step`) and the file calls it inside a
        loop or from another step function (``run_step`` calling ``optimize``), or it
        is a ``training_step`` method that steps by hand (Lightning's manual
        optimisation: ``self.manual_backward(loss)``, ``opt.step()``)."""
        if not self.runs_training_step(function):
            # A helper every step runs: called outside any branch of a step function
            # (``self._log_grad_norm()`` at the top of ``optimize``) or of a training loop.
            return function.name in self._called_from_step_functions(unconditionally=True)
        return function.name == "training_step" or function.name in self.called_in_loops() \
            or function.name in self._called_from_step_functions() or self._whole_update_called_elsewhere(function)

    def _whole_update_called_elsewhere(self, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """Whether a function's own body runs a whole update, a backward pass and an
        optimizer's step (or a helper given both), and the file never calls it: its loop
        is in another file (an RL agent's ``learn()``, a loss object's ``__call__``
        that also steps)."""
        if not self._runs_whole_update(function) and not any(
                self._runs_whole_update(callee) for name in self._own_callees(function)
                for callee in self.functions().get(name, ()) if callee is not function):
            # Nor through a helper of the file that does (XLM's ``clm_step`` ends in
            # ``self.optimize(loss)``, which runs the backward pass and the steps).
            return False
        key = "called_names"
        if key not in self.cache:
            self.cache[key] = frozenset(called_names(fast_walk(self.tree)))
        return function.name not in self.cache[key]

    def _runs_whole_update(self, function: ast.AST) -> bool:
        """Whether a function's own body runs a backward pass and an optimizer's step
        (or a helper given both). The backward passes may run in a loop of the
        function when its own body steps (BigGAN's step function: the discriminator's
        accumulated backward passes in its D-steps loop, then ``G.optim.step()``); a
        function whose steps are all in loops runs many updates, not one."""
        kinds = {self.training_kind(node) for node in self._body(function)}
        if "helper" in kinds or {"backward", "step"} <= kinds:
            return True
        return "step" in kinds and any(self.training_kind(node) == "backward" for node in walk_scope(function))

    def _called_from_step_functions(self, unconditionally: bool = False) -> frozenset[str]:
        if unconditionally:
            key = "called_unconditionally_from_step_functions"
            if key not in self.cache:
                names: set[str] = set()
                for name in self._called_from_step_functions() | self.called_in_loops() | {"training_step"}:
                    for function in self.functions().get(name, ()):
                        if self.runs_training_step(function):
                            names |= _unconditional_calls(function) & set(self.functions())
                # ... or outside any branch of a training loop's body (StarGAN v2's
                # ``compute_d_loss(...)`` before ``d_loss.backward()``).
                for loop in self.nodes(*LOOP_TYPES):
                    if self.runs_training_step(loop):
                        names |= _unconditional_calls(loop) & set(self.functions())
                # ... and what those helpers call outside their branches, in turn (a loss
                # helper's own ``cal_loss(...)``).
                todo = list(names)
                while todo:
                    for function in self.functions().get(todo.pop(), ()):
                        more = (_unconditional_calls(function) & set(self.functions())) - names
                        names |= more
                        todo.extend(more)
                self.cache[key] = frozenset(names)
            return self.cache[key]
        key = "called_from_step_functions"
        if key not in self.cache:
            self.cache[key] = frozenset()  # a cycle of calls reads the names found so far
            names: set[str] = set()
            for name in self.called_in_loops() | {"training_step"}:
                for function in self.functions().get(name, ()):
                    if self.runs_training_step(function):
                        names |= self._own_callees(function)
            grown = True
            while grown:
                grown = False
                for name in sorted(names):
                    for function in self.functions().get(name, ()):
                        if self.runs_training_step(function):
                            more = self._own_callees(function) - names
                            if more:
                                names |= more
                                grown = True
            self.cache[key] = frozenset(names)
        return self.cache[key]

    def functions(self) -> dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]:
        """Every function and method the file defines, by name."""
        key = "functions"
        if key not in self.cache:
            found: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
            for node in self.nodes(ast.FunctionDef, ast.AsyncFunctionDef):
                found.setdefault(node.name, []).append(node)
            self.cache[key] = found
        return self.cache[key]

    def _own_callees(self, scope: ast.AST) -> set[str]:
        """Names the scope's own body calls (not nested loops or functions) that the
        file defines."""
        calls = [n for n in self._body(scope) if isinstance(n, ast.Call)]
        return called_names(calls) & set(self.functions())

    def _body(self, scope: ast.AST) -> list[ast.AST]:
        """:func:`_own_body` of ``scope``, read once per file (each training-step
        question asks it again of the same loops and functions)."""
        key = ("own_body", id(scope))
        if key not in self.cache:
            self.cache[key] = _own_body(scope)
        return self.cache[key]

    def runs_training_step(self, loop: ast.AST) -> bool:
        """Whether the loop's (or function's) own body, not nested loops or
        functions, runs a training step: calls ``backward()`` or an optimizer's
        ``step()`` (see :meth:`is_training_call`), or a function of this file whose
        own body does (``self.run_step(batch)``, at most three calls deep)."""
        return self._trains(loop, 3)

    def _trains(self, scope: ast.AST, depth: int) -> bool:
        key = ("runs_training_step", id(scope), depth)
        if key not in self.cache:
            self.cache[key] = False  # a function that calls itself does not train through that call
            calls = self._training_calls()
            if not calls:
                return False  # nothing in the file trains: no body to read
            found = self._spans_a_training_call(scope, calls) and any(
                self.is_training_call(node) for node in self._body(scope))
            if not found and depth > 0:
                found = any(self._trains(function, depth - 1) for name in self._own_callees(scope)
                            for function in self.functions()[name])
            self.cache[key] = found
        return self.cache[key]

    def _training_calls(self) -> list[tuple[int, int]]:
        """Where the file's training calls (:meth:`is_training_call`) start, sorted."""
        key = "training_calls"
        if key not in self.cache:
            self.cache[key] = sorted((n.lineno, n.col_offset) for n in self.nodes(ast.Call) if self.is_training_call(n))
        return self.cache[key]

    @staticmethod
    def _spans_a_training_call(scope: ast.AST, calls: list[tuple[int, int]]) -> bool:
        """Whether a training call starts within the scope's text (its own body, or a
        nested loop's or function's): a body without one need not be read."""
        start = (scope.lineno, scope.col_offset)  # type: ignore[attr-defined]
        end = (scope.end_lineno, scope.end_col_offset)  # type: ignore[attr-defined]
        at = bisect.bisect_left(calls, start)
        return at < len(calls) and calls[at] <= end

    def is_training_call(self, node: ast.AST) -> bool:
        """A ``backward()`` call (``accelerator.backward(loss)``, Lightning's
        ``manual_backward``), ``torch.autograd.backward``, the ``step()`` of an
        optimizer (a name assigned from an optimizer class, or containing "opt") or a
        ``step(optimizer)`` that steps one (``scaler.step(opt)``), or a helper given a
        loss first and an optimizer (``loss_scaler(loss, optimizer)``); an LR
        scheduler's ``step()`` is not one, nor ``save(model, optimizer, loss)``."""
        if not isinstance(node, ast.Call):
            return False
        func = node.func
        arguments = [*node.args, *(k.value for k in node.keywords)]
        if any(self._names_optimizer(a) for a in arguments) and (
                (isinstance(func, ast.Attribute) and func.attr == "step")
                or (node.args and _names_loss(node.args[0]))):
            return True
        if isinstance(func, ast.Attribute):
            if func.attr in ("backward", "manual_backward"):
                return True
            if func.attr == "step":
                receiver = func.value
                if isinstance(receiver, ast.Attribute):
                    name = receiver.attr
                elif isinstance(receiver, ast.Name):
                    name = receiver.id
                else:
                    return False
                if "sched" in name.lower() or name in self._assigned_from(_is_scheduler_name):
                    return False
                return "opt" in name.lower() or name in self.optimizer_names()
        return self.qualified_name(func) == "torch.autograd.backward"

    def training_kind(self, node: ast.AST) -> str | None:
        """What a training call does (see :meth:`is_training_call`): ``backward``, an
        optimizer's ``step``, or ``helper`` for a call given the loss and an optimizer
        that may do both (apex's ``amp.scale_loss``, timm's ``loss_scaler``); None for
        any other node."""
        if not self.is_training_call(node):
            return None
        func = node.func  # type: ignore[attr-defined]
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("backward", "manual_backward") or self.qualified_name(func) == "torch.autograd.backward":
            return "backward"
        if name == "step" and node.args and _names_loss(node.args[0]):  # type: ignore[attr-defined]
            return "helper"  # an optimizer wrapper's ``step(loss)`` (tianshou): backward and step
        return "step" if name == "step" else "helper"

    def _names_optimizer(self, node: ast.AST) -> bool:
        """An argument that holds an optimizer: a name assigned from an optimizer
        class, or named like one (``optimizer``, ``opt``, ``self.opt_g``)."""
        name = _last_name(node)
        return name is not None and (name in self.optimizer_names() or bool(_OPTIMIZER_NAME.search(name)))

    def optimizer_names(self) -> frozenset[str]:
        """Names assigned from a ``torch.optim`` (or torch_npu/apex) optimizer."""
        return self._assigned_from(_is_optimizer_name)

    def name_values(self, chains: bool = False) -> dict[str, list[ast.expr]]:
        """Every value the file assigns to a name by a plain ``name = value`` (one
        target), by name, in the order of :meth:`nodes`. Scope-blind. With ``chains``,
        each name of ``a = b = value`` too."""
        key = "name_values"
        if key not in self.cache:
            single: dict[str, list[ast.expr]] = {}
            chained: dict[str, list[ast.expr]] = {}
            for node in self.nodes(ast.Assign):
                if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    single.setdefault(node.targets[0].id, []).append(node.value)
                for name in {t.id for t in node.targets if isinstance(t, ast.Name)}:
                    chained.setdefault(name, []).append(node.value)
            self.cache[key] = (single, chained)
        return self.cache[key][1 if chains else 0]

    def single_assignments(self) -> dict[str, ast.expr]:
        """Names bound exactly once in the file by a plain ``name = value``, with
        their value. Scope-blind; a name bound twice is left out rather than guessed."""
        key = "single_assignments"
        if key not in self.cache:
            values: dict[str, ast.expr] = {}
            seen: set[str] = set()
            for node in self.nodes(ast.Assign):
                if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    name = node.targets[0].id
                    if name in seen:
                        values.pop(name, None)
                    else:
                        values[name] = node.value
                    seen.add(name)
            self.cache[key] = values
        return self.cache[key]

    def _assigned_from(self, predicate) -> frozenset[str]:
        """Names (and attribute names) assigned from a call whose qualified name
        satisfies ``predicate``."""
        key = ("assigned_from", predicate)
        if key not in self.cache:
            names = set()
            for node in self.nodes(ast.Assign):
                if isinstance(node.value, ast.Call):
                    if predicate(self.call_name(node.value) or ""):
                        for t in node.targets:
                            if isinstance(t, ast.Name):
                                names.add(t.id)
                            elif isinstance(t, ast.Attribute):
                                names.add(t.attr)
            self.cache[key] = frozenset(names)
        return self.cache[key]


_OPTIMIZER_NAME = re.compile(r"(^|_)(opt|optim|optimi[sz]er)s?($|_)", re.IGNORECASE)


def _last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _names_loss(node: ast.AST) -> bool:
    name = _last_name(node)
    return name is not None and "loss" in name.lower()


def _unconditional_calls(function: ast.AST) -> set[str]:
    """Names a function calls in statements that run whenever it runs: its body's own
    statements, ``with`` and ``try`` bodies included, not branches or loops."""
    stack: list[ast.AST] = list(function.body)  # type: ignore[attr-defined]
    calls: list[ast.AST] = []
    while stack:
        stmt = stack.pop()
        if isinstance(stmt, (ast.With, ast.AsyncWith, ast.Try)):
            stack.extend(stmt.body)
            continue
        if isinstance(stmt, (ast.If, *LOOP_TYPES, *BOUNDARY_TYPES, ast.Match)) or type(stmt).__name__ == "TryStar":
            continue
        calls.extend(n for n in fast_walk(stmt) if isinstance(n, ast.Call))
    return called_names(calls)


def _own_body(scope: ast.AST) -> list[ast.AST]:
    """The nodes a loop's or function's own body runs: not those of nested loops or
    definitions (a ``while`` loop's test included)."""
    stack: list[ast.AST] = list(scope.body)  # type: ignore[attr-defined]
    if isinstance(scope, ast.While):
        stack.append(scope.test)
    found: list[ast.AST] = []
    while stack:
        node = stack.pop()
        found.append(node)
        if not isinstance(node, (*LOOP_TYPES, *BOUNDARY_TYPES)):
            stack.extend(child_nodes(node))
    return found


def called_names(nodes: Iterable[ast.AST]) -> set[str]:
    """The names the calls among ``nodes`` call: ``f`` of ``f(x)``, ``step`` of
    ``self.step(x)``."""
    names = set()
    for node in nodes:
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                names.add(func.attr)
            elif isinstance(func, ast.Name):
                names.add(func.id)
    return names


def _repeats(loop: ast.AST, child: ast.AST) -> bool:
    """Whether ``child`` (a direct child of ``loop``) runs on every iteration."""
    if any(child is s for s in loop.body):  # type: ignore[attr-defined]
        return True
    return isinstance(loop, ast.While) and child is loop.test


def _is_scheduler_name(qualified: str) -> bool:
    return qualified.startswith("torch.optim.lr_scheduler.")


def _is_optimizer_name(qualified: str) -> bool:
    if _is_scheduler_name(qualified):
        return False
    return qualified.startswith(("torch.optim.", "torch_npu.optim.", "apex.optimizers.")) and (
        qualified.rsplit(".", 1)[-1][:1].isupper()
    )


#: For each node type, the fields that can hold child nodes (found on first use).
CHILD_FIELDS: dict[type, tuple[str, ...]] = {}
#: Fields that hold a name, a number or a flag in every node type that has them, never
#: a node (``ctx``, Load/Store, carries nothing a rule looks at either).
_SCALAR_FIELDS = frozenset({
    "ctx", "name", "id", "attr", "arg", "asname", "module", "level", "kind", "type_comment",
    "conversion", "is_async", "simple", "tag", "lineno", "rest", "kwd_attrs",
})
#: (node type, field) pairs named like a scalar field that hold a node: Python 3.12's
#: ``type X = ...`` (``TypeAlias.name`` is a ``Name``).
_NODE_FIELDS = frozenset({("TypeAlias", "name")})
#: Node types whose remaining fields hold constants, not nodes.
_CONSTANT_TYPES = frozenset(t for t in (getattr(ast, n, None) for n in (
    "Constant", "Num", "Str", "Bytes", "NameConstant", "MatchSingleton", "Global", "Nonlocal")) if t)


def child_fields(node_type: type) -> tuple[str, ...]:
    """The fields of a node type that can hold child nodes: not the ones that only ever
    hold names, numbers and flags, nor ``ctx``."""
    fields = CHILD_FIELDS.get(node_type)
    if fields is None:
        fields = CHILD_FIELDS[node_type] = () if node_type in _CONSTANT_TYPES else tuple(
            f for f in node_type._fields if f not in _SCALAR_FIELDS or (node_type.__name__, f) in _NODE_FIELDS)
    return fields


def child_nodes(node: ast.AST) -> list[ast.AST]:
    """The direct children of a node, in :func:`ast.iter_child_nodes`' order less
    ``ctx``, at a fraction of its cost."""
    fields = CHILD_FIELDS.get(type(node))
    if fields is None:
        fields = child_fields(type(node))
    children: list[ast.AST] = []
    AST = ast.AST
    for name in fields:
        value = getattr(node, name, None)
        if value is None:
            continue
        if type(value) is list:
            for item in value:
                if isinstance(item, AST):
                    children.append(item)
        elif isinstance(value, AST):
            children.append(value)
    return children


def fast_walk(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a subtree in :func:`ast.walk`'s order (breadth first), faster."""
    queue = [node]
    i = 0
    while i < len(queue):
        current = queue[i]
        i += 1
        queue.extend(child_nodes(current))
        yield current


def preorder(tree: ast.AST) -> tuple[list[ast.AST], list[int]]:
    """Every node of a tree in source (depth-first) order, and the depth of each (the
    root's is 0). Sorting these nodes by depth, stably, gives :func:`ast.walk`'s order."""
    order: list[ast.AST] = []
    depths: list[int] = []
    stack: list[ast.AST] = [tree]
    stack_depths: list[int] = [0]
    fields_of = CHILD_FIELDS
    while stack:
        node = stack.pop()
        depth = stack_depths.pop()
        order.append(node)
        depths.append(depth)
        if not fields_of.get(type(node), True):
            continue  # a name or a constant: no children
        children = child_nodes(node)
        if children:
            children.reverse()
            stack.extend(children)
            stack_depths.extend([depth + 1] * len(children))
    return order, depths


def walk_scope(node: ast.AST) -> Iterator[ast.AST]:
    """Walk a subtree without entering nested functions, lambdas or classes."""
    stack = child_nodes(node)
    while stack:
        child = stack.pop()
        yield child
        if not isinstance(child, BOUNDARY_TYPES):
            stack.extend(child_nodes(child))


def imported_module_names(ctx: FileContext) -> list[str]:
    """Every name an import statement of the file could be a module of this project
    by: each part of ``import a.b``, of ``from a.b import c`` (``c`` too: it may be a
    module) and of relative imports (``from . import engine``, ``from .engine import
    train``), sorted."""
    names: set[str] = set()
    for node in ctx.nodes(ast.Import, ast.ImportFrom):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names.update(alias.name.split("."))
        elif isinstance(node, ast.ImportFrom):
            if node.module:
                names.update(node.module.split("."))
            names.update(alias.name for alias in node.names if alias.name != "*")
    return sorted(names)


def _collect_imports(tree: ast.Module) -> dict[str, str]:
    """Map each name bound by an import anywhere in the file to its dotted origin.

    ``import torch.nn.functional`` binds ``torch`` (to ``torch``); aliases bind the
    full path. Relative imports are skipped: they are the user's own code. Imports are
    statements, so only statement lists are walked, never expressions.
    """
    names: dict[str, str] = {}
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names.setdefault(alias.asname, alias.name)
                else:
                    head = alias.name.split(".", 1)[0]
                    names.setdefault(head, head)
        elif isinstance(node, ast.ImportFrom):
            if node.module and not node.level:
                for alias in node.names:
                    if alias.name != "*":
                        names.setdefault(alias.asname or alias.name, f"{node.module}.{alias.name}")
        else:
            for name in _STATEMENT_FIELDS:
                block = getattr(node, name, None)
                if block:
                    stack.extend(block)
    return names


def _attribute_chain(node: ast.AST) -> tuple[str, list[str]] | None:
    """``a.b.c`` -> ``("a", ["b", "c"])``; None unless a name heads the chain."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id, parts[::-1]) if isinstance(node, ast.Name) else None


def _collect_origins(imports: list[ast.Import | ast.ImportFrom]) -> dict[str, tuple[str, int, str | None]]:
    """Each name an import statement binds -> ``(module, level, name)``: the module
    written (dots stripped, ``level`` of them), and the name taken from it (None for
    ``import a.b [as x]``, which binds a module). ``imports``: the file's import
    statements in :func:`ast.walk`'s order (the first binding of a name wins)."""
    origins: dict[str, tuple[str, int, str | None]] = {}
    for node in imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    origins.setdefault(alias.asname, (alias.name, 0, None))
                else:
                    head = alias.name.split(".", 1)[0]
                    origins.setdefault(head, (head, 0, None))
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name != "*":
                    origins.setdefault(alias.asname or alias.name, (node.module or "", node.level, alias.name))
    return origins


#: Fields of compound statements that hold statement lists (or handlers/cases).
_STATEMENT_FIELDS = ("body", "orelse", "finalbody", "handlers", "cases")
