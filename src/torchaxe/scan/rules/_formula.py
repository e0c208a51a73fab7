"""Shared machinery of the formula rules (AX110-AX120, AX123): each rule reports the
matches of one category that ``torchaxe.scan.formulas.analysis`` found in the file
and proposes the fused replacement for the target.

A rewrite is offered only where it is certain: every input has source text, nothing
the fused operator cannot express (another layout, a mask it has no argument for) is
involved, and the hand-written computation is either one expression or a chain of
statements that ``formulas.spread`` can delete with it (an unsafe fix then: it deletes
code). Otherwise the finding shows the replacement as advice. Not a rule
module (the leading underscore keeps the registry out).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Iterable

from torchaxe.findings import Applicability, Edit, Finding, Position
from torchaxe.scan.context import child_nodes, fast_walk
from torchaxe.scan.rules.base import Rule

if TYPE_CHECKING:
    from torchaxe.scan.context import FileContext
    from torchaxe.scan.formulas.analysis import FormulaMatch
    from torchaxe.scan.formulas.spread import Plan

UNVERIFIED = "unverified on Ascend hardware"
#: A fix that keeps numerics is called safe only when the hand-written form is the
#: exact formula (its constants are not truncated beyond float32 precision).
SAFE_RELATIVE_ERROR = 1e-6


@dataclass(frozen=True)
class Proposal:
    """What a rule proposes for one match on one target."""

    replacement: str
    #: The advice part of the message: why the replacement is faster, what changes.
    note: str
    title: str
    applicability: Applicability = Applicability.SAFE
    #: Whether ``replacement`` may replace the matched expression in place.
    edit: bool = True
    imports: tuple[str, ...] = ()
    #: The replacement handles the plan's guard (``if mask is not None:``).
    guarded: bool = False


class FormulaRule(Rule):
    """Base of the formula rules; subclasses set ``category``, ``label`` and ``propose``."""

    #: What the formula is called in messages ("tanh-approximation GELU").
    label: ClassVar[str] = ""
    #: The fused call takes ``inplace=True`` (F.silu), for a form written in place.
    inplace_argument: ClassVar[bool] = False
    #: The fix's usual applicability per target, for an exact hand-written form
    #: written as one expression (``torchaxe verify`` checks the safe ones).
    safety_by_target: ClassVar[dict[str, Applicability]] = {}
    uses_formulas = True

    def check_module(self, ctx: FileContext) -> Iterable[Finding]:
        from torchaxe.scan.formulas.analysis import formula_matches

        for match in formula_matches(ctx):
            if match.category == self.category and self.reports(ctx, match):
                yield self.report(ctx, match)

    def reports(self, ctx: FileContext, match: FormulaMatch) -> bool:
        """Whether a match of the rule's formula is reported (a rule may leave out a
        match that only looks like its formula in context)."""
        return True

    def propose(self, ctx: FileContext, match: FormulaMatch) -> Proposal:
        raise NotImplementedError

    def report(self, ctx: FileContext, match: FormulaMatch) -> Finding:
        proposal = self.propose(ctx, match)
        message = (
            f"{self.label} written out by hand in {match.scope_name}: it matches {match.reference} "
            f"on random probes (max error {match.max_abs:.1e}); {proposal.note}"
        )
        assumed = match.params.get("size_assumed")
        if assumed:
            # self.scale = dim ** -0.5 in __init__, read as a power of the data's size.
            parts = [name.rsplit(".", 1) for name in assumed]
            message += "; this assumes " + ", ".join(
                f"the {size} given to __init__ (which sets {attr}) is the size of the dimension the formula works "
                f"over" for attr, size in parts) + ": check it, then make the change by hand"
            proposal = replace(proposal, edit=False)
        applicability = proposal.applicability
        edits: list[Edit] = []
        written = _in_place(ctx, match) if proposal.edit else None  # a walk of the file: only for a fix
        if written:
            if self.inplace_argument and proposal.replacement.endswith(")"):
                # x.mul_(x.sigmoid()): the caller may rely on x holding the result.
                proposal = replace(proposal, replacement=proposal.replacement[:-1] + ", inplace=True)")
            else:
                proposal = replace(proposal, edit=False)
                message += f" (the hand-written form writes its input in place ({written}), the fused call does not)"
        if proposal.edit and match.fixable:
            edits = [ctx.replace(match.node, proposal.replacement)]
        elif proposal.edit and match.spread and match.plan is not None and (
                match.plan.guard is None or proposal.guarded):
            # The statements that built it go too; deleting code is for the user to review.
            edits = [ctx.replace(match.node, proposal.replacement), *_deletions(ctx, match.plan)]
            message += (f" (the formula is assembled from several statements: the fix also deletes "
                        f"{_lines_text(match.plan)}, used only to build it)")
            if applicability is Applicability.SAFE:
                applicability = Applicability.UNSAFE
        elif match.spread:
            message += " (the formula is assembled from several statements, so there is no automatic fix)"
            branches = _branches_left_out(ctx, match)
            if branches:
                example = " (a mask as attn_mask= or is_causal=, for instance)" if match.category == "attention" else ""
                message += (f"; the code also changes {branches} on some runs only, and the replacement is one "
                            f"fixed computation: make it follow that condition by hand{example} or keep the "
                            "hand-written form")
        if "torch_npu" in proposal.replacement and UNVERIFIED not in message:
            message += f"; {UNVERIFIED}"
        fix = ctx.fix(
            self,
            edits,
            imports=proposal.imports if edits else (),
            applicability=applicability if edits else Applicability.DISPLAY_ONLY,
            title=proposal.title,
        )
        return ctx.finding(self, match.node, message, replacement=proposal.replacement, fix=fix)


# ---------------------------------------------------------------- helpers
def expression_at(root: ast.AST, span) -> ast.expr | None:
    """The outermost expression under ``root`` that spans exactly ``span``."""
    where = (span.lineno, span.col_offset, span.end_lineno, span.end_col_offset)
    return next((n for n in fast_walk(root) if isinstance(n, ast.expr)
                 and (n.lineno, n.col_offset, n.end_lineno, n.end_col_offset) == where), None)


def _in_place(ctx: FileContext, match: FormulaMatch) -> str | None:
    """The in-place method (``mul_``) the matched expression ends with, if any."""
    node = expression_at(ctx.tree, match.node)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        attr = node.func.attr
        return attr if attr.endswith("_") and not attr.endswith("__") else None
    return None


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _definitions(ctx: FileContext) -> list[ast.AST]:
    """The file's functions, lambdas and classes, found in one walk per file."""
    if "definitions" not in ctx.cache:
        ctx.cache["definitions"] = ctx.nodes(*_DEFINITIONS)
    return ctx.cache["definitions"]


def innermost(ctx: FileContext, line: int, kinds: tuple[type, ...]) -> ast.AST | None:
    """The innermost definition of one of ``kinds`` (functions, classes) whose lines
    hold ``line``."""
    found = None
    for node in _definitions(ctx):
        if isinstance(node, kinds) and node.lineno <= line <= (node.end_lineno or node.lineno):  # type: ignore[attr-defined]
            if found is None or node.lineno > found.lineno:  # type: ignore[attr-defined]
                found = node
    return found


def _branches_left_out(ctx: FileContext, match: FormulaMatch) -> str:
    """Where a name the matched expression reads (directly or through the statements
    that built it) is assigned again under an ``if`` before it: ``att under `if
    self.causal:` (line 44)``. A formula read with that branch skipped (or taken) is not
    the whole computation."""
    line = match.node.lineno
    function = innermost(ctx, line, (ast.FunctionDef, ast.AsyncFunctionDef))
    if function is None:
        return ""
    # Every assignment before the matched line, with the ``if`` it sits under (if any).
    assignments: list[tuple[ast.stmt, ast.If | None]] = []

    def visit(stmts: list[ast.stmt], under: ast.If | None) -> None:
        for stmt in stmts:
            if stmt.lineno >= line:
                return
            if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                assignments.append((stmt, under))
            elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                    and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr.endswith("_") \
                    and isinstance(stmt.value.func.value, ast.Name):
                # ``dots.masked_fill_(mask, value)``: a new value of ``dots``.
                written = ast.Assign(targets=[ast.Name(id=stmt.value.func.value.id, ctx=ast.Store())],
                                     value=stmt.value)
                assignments.append((ast.copy_location(written, stmt), under))
            elif isinstance(stmt, ast.If):
                visit(stmt.body, stmt)
                visit(stmt.orelse, stmt)
            elif isinstance(stmt, (ast.With, ast.AsyncWith, ast.Try)):
                visit(stmt.body, under)

    visit(function.body, None)
    expression = expression_at(function, match.node)
    if expression is None:
        return ""
    # The names the formula's inputs are written with: a branch about one of them
    # (``if mask is not None:``, the mask itself) is in the formula already.
    inputs: set[str] = set()
    for text in match.inputs.values():
        try:
            inputs |= {n.id for n in fast_walk(ast.parse(text or "", mode="eval")) if isinstance(n, ast.Name)}
        except SyntaxError:
            continue
    inputs.discard("self")
    wanted = {n.id for n in fast_walk(expression) if isinstance(n, ast.Name)}
    branches: dict[int, tuple[ast.If, list[str]]] = {}
    # A data input's own assignments are the input's: the replacement reads that name
    # after them, whatever branch made it (``k = torch.cat([past[0], k])``). A mask made
    # under a condition is still named.
    seen: set[str] = set()
    for role in ("q", "k", "v", "x"):
        text = match.inputs.get(role)
        if text and text.isidentifier():
            seen.add(text)
    while wanted - seen:
        name = (wanted - seen).pop()
        seen.add(name)
        for stmt, under in assignments:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if not any(isinstance(t, ast.Name) and t.id == name for target in targets for t in fast_walk(target)):
                continue
            if stmt.value is not None:
                wanted |= {n.id for n in fast_walk(stmt.value) if isinstance(n, ast.Name)}
            if under is not None:
                names = branches.setdefault(id(under), (under, []))[1]
                if name not in names:
                    names.append(name)
    found = []
    for under, names in sorted(branches.values(), key=lambda b: b[0].lineno):
        # A branch about an input (``if mask is not None:``) is the input's own: the
        # formula takes it as it comes. A mask made under another condition (``if
        # self.causal:``) is applied on some runs only.
        about = {n.id for n in fast_walk(under.test) if isinstance(n, ast.Name)}
        if about & inputs:
            continue
        test = ctx.text(under.test) or ast.unparse(under.test)
        found.append(f"{', '.join(sorted(names))} under `if {test}:` (line {under.lineno})")
    return "; ".join(found)


def _deletions(ctx: FileContext, plan: Plan) -> list[Edit]:
    """Edits deleting each planned line range whole (its newline included)."""
    edits = []
    for first, last in plan.delete:
        end = Position(last + 1, 1) if last < len(ctx.lines) else Position(last, len(ctx.lines[last - 1]) + 1)
        edits.append(Edit(Position(first, 1), end, ""))
    return edits


def _lines_text(plan: Plan) -> str:
    """``line 35`` or ``lines 28-30, 33``: the deleted statements, contiguous ones merged."""
    merged: list[list[int]] = []
    for first, last in plan.delete:
        if merged and first == merged[-1][1] + 1:
            merged[-1][1] = last
        else:
            merged.append([first, last])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in merged]
    return f"line {parts[0]}" if parts == [str(merged[0][0])] else f"lines {', '.join(parts)}"


def _bound_names(scope: ast.AST) -> set[str]:
    """The names a function (its parameters and body, nested scopes left out) or a
    module (everything but its imports) binds."""
    names: set[str] = set()
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        a = scope.args
        names.update(arg.arg for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if arg)
        body: list[ast.AST] = list(scope.body) if isinstance(scope.body, list) else [scope.body]
    else:
        body = list(getattr(scope, "body", []))
    stack = body
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            stack.extend(node.decorator_list)
            continue  # its own scope
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not isinstance(scope, ast.Module):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        stack.extend(child_nodes(node))
    return names


def shadowed(ctx: FileContext, line: int | None) -> set[str]:
    """Names bound, at ``line``, by the functions around it or by the module other
    than by an import (``B, T, F = spec.shape`` in audio code): a replacement must not
    name ``torch.nn.functional`` as ``F`` there."""
    if line is None:
        return set()
    key = ("shadowed", line)
    if key not in ctx.cache:
        if ("shadowed", "module") not in ctx.cache:
            ctx.cache[("shadowed", "module")] = frozenset(_bound_names(ctx.tree))
        names = set(ctx.cache[("shadowed", "module")])
        for node in _definitions(ctx):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) \
                    and node.lineno <= line <= (node.end_lineno or node.lineno):
                bound = ("shadowed", "bound", id(node))
                if bound not in ctx.cache:
                    ctx.cache[bound] = frozenset(_bound_names(node))
                names |= ctx.cache[bound]
        ctx.cache[key] = frozenset(names)
    return set(ctx.cache[key])


def functional(ctx: FileContext, line: int | None = None) -> tuple[str, tuple[str, ...]]:
    """How this file can name ``torch.nn.functional`` at ``line`` (an alias the code
    around it does not rebind), and the import that needs."""
    taken = shadowed(ctx, line)
    for name, origin in sorted(ctx.imports.items()):
        if origin == "torch.nn.functional" and name not in taken:
            return name, ()
    if ctx.imports.get("torch") == "torch" and "torch" not in taken:
        return "torch.nn.functional", ()
    if "F" not in ctx.imports and "F" not in taken:
        return "F", ("import torch.nn.functional as F",)
    return "torch.nn.functional", ("import torch",)


def fused_activation(ctx: FileContext, match: FormulaMatch, op: str) -> Proposal:
    """The safe proposal of an activation with one fused functional call,
    ``F.<op>(x)`` (SiLU, Mish): same function, one kernel each way."""
    fn, imports = functional(ctx, match.node.lineno)
    replacement = f"{fn}.{op}({match.inputs['x']})"
    return Proposal(replacement, f"{replacement} computes it in one fused kernel, forward and backward",
                    f"use F.{op}(x)", Applicability.SAFE, imports=imports)


def torch_name(ctx: FileContext, line: int | None = None) -> tuple[str, tuple[str, ...]]:
    """How this file can name ``torch`` at ``line``, and the import that needs."""
    taken = shadowed(ctx, line)
    for name, origin in sorted(ctx.imports.items()):
        if origin == "torch" and name not in taken:
            return name, ()
    return "torch", ("import torch",)


_SIMPLE = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)
_NAME_CHAIN = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*(\.[A-Za-z_][A-Za-z_0-9]*)*$")


def atom(text: str) -> str:
    """``text`` made safe to put before ``.attr`` or after a unary operator."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return f"({text})"
    return text if isinstance(node, _SIMPLE) else f"({text})"


def is_name(text: str | None) -> bool:
    """A plain name or attribute chain: cheap and side-effect free to repeat."""
    return text is not None and bool(_NAME_CHAIN.match(text.strip()))


def over_named_dim(proposal: Proposal, match: FormulaMatch) -> Proposal:
    """A norm whose reductions take their dimension from a variable (``mean(self.dim)``):
    the fused norm covers the last dimension, which that may not be, so advice only."""
    names = match.params.get("dim_from")
    if not names:
        return proposal
    note = (f"{proposal.note}; the hand-written form normalises the dimension held in {', '.join(names)}, which the "
            "scan cannot read: the replacement holds only when that is the last one (-1)")
    return replace(proposal, note=note, applicability=Applicability.DISPLAY_ONLY, edit=False)


def moved_last(proposal: Proposal, match: FormulaMatch, x: str) -> Proposal:
    """A norm written over one dimension other than the last (LayerNorm over the
    channels of an NCHW tensor: ``dim=1``): the fused call's input with that dimension
    moved last and its output moved back, ``F.layer_norm(x.movedim(1, -1),
    (x.shape[1],), ...).movedim(-1, 1)``, so that the replacement shown computes what
    the code does. Unchanged when the dimension is not a written number."""
    dim = match.params.get("dim_written")
    if match.params.get("dim", -1) == -1 or not isinstance(dim, int) or dim == -1:
        return proposal
    text = proposal.replacement
    head = text.find(f"({x}, ")
    if head < 0:
        return proposal
    depth, end = 0, None
    for i in range(head, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                end = i
                break
    if end is None:
        return proposal
    inner = f"{atom(x)}.movedim({dim}, -1)" + text[head + 1 + len(x):end]
    inner = inner.replace(f"({atom(x)}.shape[-1],)", f"({atom(x)}.shape[{dim}],)", 1)
    moved = f"{text[:head + 1]}{inner}).movedim(-1, {dim}){text[end + 1:]}"
    return replace(proposal, replacement=moved, note=proposal.note.replace(text, moved, 1))


def exact(match: FormulaMatch) -> bool:
    """The hand-written form equals the reference to float32 precision."""
    return match.max_rel <= SAFE_RELATIVE_ERROR


def fmt_number(value: float) -> str:
    return repr(value) if value else "0.0"


def eps_text(match: FormulaMatch) -> str | None:
    """The epsilon's source text (or literal), None when it cannot be written."""
    if "eps" in match.inputs:
        return match.inputs["eps"]
    return fmt_number(float(match.params.get("eps", 0.0)))


def torch_version_at_least(ctx: FileContext, major: int, minor: int) -> bool | None:
    version = ctx.capabilities.get("torch_version")
    if not version:
        return None
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        return None
    return (int(m.group(1)), int(m.group(2))) >= (major, minor)
