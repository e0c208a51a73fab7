"""One file's formula matches: where they are, what their inputs are called in the
source, and whether the matched expression can be rewritten in place.

This is the only entry point the rules use. It is computed once per file (cached on
the ``FileContext``) and imports torch only when the file holds a candidate: a tree
with an operation some reference needs.
"""

from __future__ import annotations

import ast
import bisect
import gc
import itertools
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from torchaxe.scan.context import fast_walk, walk_scope
from torchaxe.scan.formulas import remote
from torchaxe.scan.formulas.inline import (
    FileUnit, Root, activation_attributes, activation_tables, has_activation_words, read_scope,
)
from torchaxe.scan.formulas.ir import CONST, VAR, Node, walk
from torchaxe.scan.formulas.lowering import SIZE_POWER_MARK
from torchaxe.scan.formulas.prefilter import anchored, worth_evaluating
from torchaxe.scan.formulas.spread import Plan
from torchaxe.scan.formulas.spread import plan as spread_plan
from torchaxe.scan.formulas.store import STORE, Match, decode, encode, file_key, root_key

if TYPE_CHECKING:
    from torchaxe.scan.context import FileContext

#: Operations a scope must call (or call a function that does) to be read at all.
#: Strong words always count; weak words (a mean, a variance, a norm) only in a
#: definition that also takes a second moment or a power (``** 0.5``, ``pow``, a
#: variance), as a norm written with them must; the rotary and SwiGLU words only on
#: npu, where they have fused operators.
STRONG_WORDS = ("tanh", "erf", "erfc", "ndtr", "sigmoid", "expit", "exp", "rsqrt", "sqrt", "softmax", "Softmax")
WEAK_WORDS = ("mean", "var", "std", "var_mean", "norm", "vector_norm")
NPU_WORDS = ("silu", "view_as_complex", "cat", "concat", "stack", "empty_like", "zeros_like", "flip")
_POWER = ("**", "pow(", "std(", "var(", "var_mean(", "square(", ".norm(")
#: ``F.normalize`` counts only in a definition that also scales by a stored factor
#: (``F.normalize(x, dim=-1) * self.scale * self.g``) or takes a power.
NORMALIZE_WORDS = ("normalize",)
_SCALE = _POWER + ("scale",)
#: A sum counts only beside a square root written as a power (a norm whose mean is
#: ``x.sum(-1) / C`` and whose root is ``** -0.5``, as llm.c writes LayerNorm).
SUM_WORDS = ("sum",)
_ROOT_POWER = ("** -0.5", "**-0.5", "** 0.5", "**0.5", "** (-0.5)", "**(-0.5)", "** (0.5)")
#: Categories with a fused operator on npu only (torch has none for them).
NPU_ONLY = frozenset({"swiglu", "rotary", "quick_gelu"})
ALL_CATEGORIES = frozenset({"attention", "rotary", "swiglu", "glu", "layer_norm", "rms_norm", "softmax", "gelu_tanh",
                            "gelu_erf", "quick_gelu", "silu", "mish"})
_CACHE_KEY = "formulas.matches"
#: A scope that already calls the fused operator keeps the hand-written form as a
#: fallback (``if self.flash: F.scaled_dot_product_attention(...) else: ...``).
#: Written as attribute calls (``F.gelu(``), so that a helper named ``gelu`` is not one.
FUSED_CALLS = {
    "attention": (".scaled_dot_product_attention(", ".npu_fusion_attention(", "flash_attn_func(",
                  "flash_attn_varlen_func(", "flash_attn_qkvpacked_func(", "flash_attn_forward(",
                  ".memory_efficient_attention("),
    "gelu_tanh": (".gelu(",), "gelu_erf": (".gelu(",), "quick_gelu": (".fast_gelu(",),
    "silu": (".silu(",), "mish": (".mish(",), "swiglu": (".npu_swiglu(",), "glu": (".glu(",), "rms_norm": (".rms_norm(", ".npu_rms_norm("),
    "layer_norm": (".layer_norm(",), "rotary": (".npu_rotary_mul(",), "softmax": (),
}
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class Span:
    """Where an expression is, with the position attributes of an ``ast`` node (so
    that the ``FileContext`` helpers take it), and nothing else: it can be stored."""

    lineno: int
    col_offset: int
    end_lineno: int
    end_col_offset: int

    @classmethod
    def of(cls, node: ast.AST) -> Span:
        return cls(node.lineno, node.col_offset, node.end_lineno or node.lineno,  # type: ignore[attr-defined]
                   node.end_col_offset or 0)  # type: ignore[attr-defined]


@dataclass
class FormulaMatch:
    """A hand-written formula found in a file."""

    category: str
    reference: str
    max_abs: float
    max_rel: float
    #: The expression to report (and, when ``fixable``, to replace).
    node: Span
    #: Source text of each input (x, weight, q, ...), None when it has none here.
    inputs: dict[str, str | None]
    params: dict[str, Any]
    #: The whole hand-written computation is this one expression, inputs excepted.
    fixable: bool
    #: The formula was assembled from several statements (locals inlined).
    spread: bool
    scope_name: str
    #: The matched tree and its scope (to drop a match nested in another).
    tree: Node | None = field(default=None, repr=False, compare=False)
    scope_id: int = field(default=0, repr=False, compare=False)
    #: ids of the functions inlined into the matched tree.
    callees: frozenset[int] = field(default=frozenset(), repr=False, compare=False)
    #: For a spread formula: the statements to delete with it (``formulas.spread``).
    plan: Plan | None = None

    @property
    def line(self) -> int:
        return self.node.lineno  # type: ignore[attr-defined]

    @property
    def end_line(self) -> int:
        return self.node.end_lineno or self.line  # type: ignore[attr-defined]

    def to_data(self) -> list[Any]:
        n = self.node
        return [self.category, self.reference, self.max_abs, self.max_rel,
                [n.lineno, n.col_offset, n.end_lineno, n.end_col_offset], self.inputs, self.params, self.fixable,
                self.spread, self.scope_name, self.plan.to_data() if self.plan else None]

    @classmethod
    def from_data(cls, data: list[Any]) -> FormulaMatch:
        category, reference, max_abs, max_rel, span, inputs, params, fixable, spread, scope_name, plan = data
        return cls(category, reference, max_abs, max_rel, Span(*span), inputs, params, fixable, spread, scope_name,
                   plan=Plan.from_data(plan))


def categories_for(target: str) -> frozenset[str]:
    return ALL_CATEGORIES if target == "npu" else ALL_CATEGORIES - NPU_ONLY


def formula_matches(ctx: FileContext) -> list[FormulaMatch]:
    """Every hand-written formula in the file, for the file's target: cached on the
    context, and stored by the file's content so that an unchanged file is not
    analysed again by a later scan."""
    cached = ctx.cache.get(_CACHE_KEY)
    if cached is None:
        key = file_key(ctx.source, ctx.target)
        stored = STORE.get_file(key)
        if stored is not None:
            cached = [FormulaMatch.from_data(d) for d in stored]
        else:
            cached = _analyse(ctx)
            STORE.put_file(key, [m.to_data() for m in cached])
        ctx.cache[_CACHE_KEY] = cached
    return cached


def analysed(ctx: FileContext) -> bool:
    """Whether a rule asked for the file's formula matches during this scan."""
    return _CACHE_KEY in ctx.cache


def covers(ctx: FileContext, definition: ast.AST) -> bool:
    """Whether a formula match lies inside a function or class definition (the
    name-level rule AX103 then leaves it to the formula rules)."""
    first = definition.lineno  # type: ignore[attr-defined]
    last = definition.end_lineno or first  # type: ignore[attr-defined]
    return any(first <= m.line and m.end_line <= last for m in formula_matches(ctx))


# ---------------------------------------------------------------- scopes
def _word_offsets(words: tuple[str, ...], source: str, skip_definitions: bool = False) -> list[int]:
    """Offsets where one of ``words`` is called: the identifier followed by ``(``
    (formula words are operations, so this misses nothing that matters and skips
    ``except``, ``expand``, ``normal``). With ``skip_definitions``, ``def word(`` does
    not count. ``str.find`` per word is several times faster than one regex."""
    offsets: list[int] = []
    for word in words:
        probe = word + "("
        pos = source.find(probe)
        while pos != -1:
            before = source[pos - 1] if pos else " "
            if not (before.isalnum() or before == "_") and not (
                    skip_definitions and source[max(0, pos - 4):pos] == "def "):
                offsets.append(pos)
            pos = source.find(probe, pos + len(probe))
    return offsets


def _text_offsets(texts: tuple[str, ...], source: str) -> list[int]:
    """Offsets of every occurrence of one of ``texts``."""
    offsets: list[int] = []
    for text in texts:
        pos = source.find(text)
        while pos != -1:
            offsets.append(pos)
            pos = source.find(text, pos + len(text))
    return offsets


def _name_offsets(names: tuple[str, ...], source: str) -> list[int]:
    """Offsets where one of ``names`` is used as a value, not called (``rotate_fn =
    rotate_half``, ``map(l2norm, (q, k))``): the call through the alias is then read."""
    pattern = re.compile(r"(?<![\w.])(?:" + "|".join(map(re.escape, names)) + r")(?![\w(])(?!\s*\()")
    return [m.start() for m in pattern.finditer(source) if not source[max(0, m.start() - 4):m.start()] == "def "]


def _to_lines(offsets: list[int], starts: list[int]) -> list[int]:
    return sorted({bisect.bisect_right(starts, o) + 1 for o in offsets})


def _overlaps(node: ast.AST, hits: list[int]) -> bool:
    first = node.lineno  # type: ignore[attr-defined]
    last = node.end_lineno or first  # type: ignore[attr-defined]
    i = bisect.bisect_left(hits, first)
    return i < len(hits) and hits[i] <= last


_COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)


def _definitions(body: list[ast.stmt], cls: ast.ClassDef | None) -> Iterator[tuple[ast.AST, ast.ClassDef | None]]:
    """Every function definition in a statement list, nested ones included, with the
    class whose method it is."""
    for stmt in body:
        if isinstance(stmt, _SCOPES):
            yield stmt, cls
            yield from _definitions(stmt.body, None)
        elif isinstance(stmt, ast.ClassDef):
            yield from _definitions(stmt.body, stmt)
        elif isinstance(stmt, _COMPOUND) or type(stmt).__name__ == "TryStar":
            for block in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, block, None)
                if inner:
                    yield from _definitions(inner, cls)
            for handler in getattr(stmt, "handlers", ()):
                yield from _definitions(handler.body, cls)


def _plan(ctx: FileContext, npu_words: bool) -> tuple[list[tuple[ast.AST, ast.ClassDef | None]], list[int], set[int]]:
    """The scopes to read, the relevant lines, and the definitions worth inlining.

    A definition holding a formula word is *hot*; a line that calls a hot
    definition by name is relevant too (``q * cos + rotate_half(q) * sin``), so its
    scope is read and the call inlined there.
    """
    source = ctx.source
    strong_words = STRONG_WORDS + NPU_WORDS if npu_words else STRONG_WORDS
    strong = _word_offsets(strong_words, source)
    weak = _word_offsets(WEAK_WORDS, source)
    scaled = _word_offsets(NORMALIZE_WORDS, source) if "normalize(" in source else []
    summed = _word_offsets(SUM_WORDS, source) + _text_offsets(_ROOT_POWER, source) \
        if any(p in source for p in _ROOT_POWER) else []
    definitions: list[tuple[ast.AST, ast.ClassDef | None]] | None = None
    if has_activation_words(source):
        definitions = list(_definitions(ctx.tree.body, None))
        strong.extend(_activation_calls(ctx, definitions))
    if not strong and not weak and not scaled and not summed:
        return [], [], set()
    starts = list(itertools.accumulate(map(len, ctx.lines)))
    hits = _to_lines(strong, starts)
    if definitions is None:
        definitions = list(_definitions(ctx.tree.body, None))
    for offsets, evidence in ((weak, _POWER), (scaled, _SCALE), (summed, _ROOT_POWER)):
        if not offsets:
            continue
        weak_lines = _to_lines(offsets, starts)
        accepted: set[int] = set()
        for d, _ in definitions:
            # Also in a definition with a strong word: a norm assigned to a local and
            # gated by a sigmoid later is read where it is assigned.
            if _overlaps(d, weak_lines):
                first, last = d.lineno, d.end_lineno or d.lineno  # type: ignore[attr-defined]
                text = "".join(ctx.lines[first - 1 : last])
                if any(p in text for p in evidence):
                    accepted.update(n for n in weak_lines if first <= n <= last)
        hits = sorted(set(hits).union(accepted))
    if not hits:
        return [], [], set()
    hot = [(d, c) for d, c in definitions if _overlaps(d, hits)]
    relevant = hits
    names = tuple(sorted({d.name for d, _ in hot}))  # type: ignore[attr-defined]
    if names:
        relevant = sorted(set(hits).union(_to_lines(_word_offsets(names, source, skip_definitions=True), starts),
                                          _to_lines(_name_offsets(names, source), starts)))
    chosen = [(d, c) for d, c in definitions if _overlaps(d, relevant)]
    if any(_overlaps(s, relevant) for s in ctx.tree.body if not isinstance(s, (*_SCOPES, ast.ClassDef))):
        chosen.append((ctx.tree, None))
    return chosen, relevant, {id(d) for d, _ in hot}


def _activation_calls(ctx: FileContext, definitions: list[tuple[ast.AST, ast.ClassDef | None]]) -> list[int]:
    """Offsets of calls ``.<attr>(`` to an attribute that ``__init__`` certainly sets
    to an activation (``self.act_fn(gate) * up`` is a SwiGLU with no formula word)."""
    classes = {id(c): c for _, c in definitions if c is not None}
    if not classes:
        return []
    tables = activation_tables(ctx.tree)
    offsets: list[int] = []
    starts: list[int] = []
    for cls in classes.values():
        init = next((s for s in cls.body if isinstance(s, _SCOPES) and s.name == "__init__"), None)
        found = activation_attributes(cls, init, ctx.qualified_name, tables)  # type: ignore[arg-type]
        if not found:
            continue
        starts = starts or [0, *itertools.accumulate(map(len, ctx.lines))]
        first, last = cls.lineno, cls.end_lineno or cls.lineno
        begin, end = starts[first - 1], starts[min(last, len(ctx.lines))]
        for attr in found:
            probe = f".{attr}("
            pos = ctx.source.find(probe, begin, end)
            while pos != -1:
                offsets.append(pos + 1)
                pos = ctx.source.find(probe, pos + len(probe), end)
    return offsets


def _scope_name(scope: ast.AST, cls: ast.ClassDef | None) -> str:
    if isinstance(scope, _SCOPES):
        return f"{cls.name}.{scope.name}" if cls is not None else scope.name  # type: ignore[attr-defined]
    if isinstance(scope, ast.Lambda):
        return "a lambda"
    return "module level"


# ---------------------------------------------------------------- analysis
def _analyse(ctx: FileContext) -> list[FormulaMatch]:
    """The matches of the file for its target. The NPU's own formulas (rotary, SwiGLU)
    need more definitions read and inlined; inlined, a helper can turn another formula's
    input into a tree the probes cannot evaluate (a complex rotary feeding the query of
    an attention). So when those words change the plan, the file is also read with the
    plan every target uses, and a formula found only that way is added where it lies
    outside every formula of the wider reading (a SiLU inside a SwiGLU stays the
    SwiGLU's)."""
    if ctx.target != "npu":
        return _analyse_plan(ctx, _plan(ctx, npu_words=False), categories_for(ctx.target))
    wide = _plan(ctx, npu_words=True)
    narrow = _plan(ctx, npu_words=False)
    found = _analyse_plan(ctx, wide, ALL_CATEGORIES)
    if wide[1] == narrow[1] and wide[2] == narrow[2]:
        return found
    taken: set[int] = set()
    for m in found:
        taken.update(range(m.line, m.end_line + 1))
        for first, last in m.plan.delete if m.plan is not None else ():
            taken.update(range(first, last + 1))
    kinds = {(m.scope_name, m.category) for m in found}
    more = [m for m in _analyse_plan(ctx, narrow, ALL_CATEGORIES - NPU_ONLY)
            if (m.scope_name, m.category) not in kinds and not taken.intersection(range(m.line, m.end_line + 1))]
    return sorted(found + more, key=lambda m: (m.line, m.node.col_offset, m.category)) if more else found


def _analyse_plan(ctx: FileContext, plan: tuple[list[tuple[ast.AST, ast.ClassDef | None]], list[int], set[int]],
                  categories: frozenset[str]) -> list[FormulaMatch]:
    scopes, relevant, hot = plan
    if not scopes:
        return []
    unit = FileUnit(ctx.imports, ctx.qualified_name, ctx.text, ctx.tree, ctx.lines, relevant, hot)
    roots: list[tuple[Root, str]] = []
    for scope, cls in scopes:
        try:
            name = _scope_name(scope, cls)
            roots.extend((r, name) for r in read_scope(unit, scope, cls))
        except RecursionError:
            continue
    while unit.lambdas:
        lam, cls = unit.lambdas.pop()
        try:
            roots.extend((r, "a lambda") for r in read_scope(unit, lam, cls))
        except RecursionError:
            continue
    candidates = [(r, n) for r, n in roots if r.node.size >= 3 and r.node.vars and anchored(r.node)]
    if not candidates:
        return []
    results = _fingerprints([r.node for r, _ in candidates], categories)
    found: list[FormulaMatch] = []
    reported: set[tuple[int, int]] = set()
    fused_seen: dict[tuple[int, str], bool] = {}
    placed: set[tuple[int, str, Span | None]] = set()
    for (root, scope_name), matches in zip(candidates, results):
        for match in matches:
            key = (id(root.scope), id(match.node))
            if key in reported:
                continue
            if _has_fused_call(ctx, root.scope, match.category, fused_seen) and not _other_layout(match):
                continue
            if _old_torch_only(ctx, root.scope):
                continue
            if match.category == "attention" and _keeps_top_scores(ctx, root.scope):
                continue
            if (match.params.get("sign_folded") or match.params.get("fitted")) and match.category == "rotary" \
                    and not _ROTARY_NAME.search(scope_name):
                # x * c + swap(x) * s, or a pair mix with a table viewed to fit: as likely
                # a boost or a learned mix as a rotary.
                continue
            located = _locate(ctx, root, match, scope_name)
            if located is not None and not _key_named(located):
                continue
            place = (id(root.scope), match.category, located.node if located else None)
            if located is not None and place not in placed:
                # The second reading of a scope (branches skipped) only adds new places.
                reported.add(key)
                placed.add(place)
                found.append(located)
    found = _drop_nested(found)
    # A formula written in a helper and completed by its caller (LLaMA's
    # ``self._norm(x.float()).type_as(x) * self.weight``) is reported in the helper.
    written = {(m.scope_id, m.category) for m in found}
    found = [m for m in found if not any((c, m.category) in written for c in m.callees)]
    # A lambda that ``map`` applies is read where it is applied and alone: one report
    # per place, the first (the enclosing scope's, read before the lambdas).
    places: set[tuple[int, int, str]] = set()
    unique = []
    for m in found:
        place = (m.node.lineno, m.node.col_offset, m.category)
        if place not in places:
            places.add(place)
            unique.append(m)
    found = unique
    found.sort(key=lambda m: (m.line, m.node.col_offset))
    return found


#: A function named like a rotary embedding (Yarn.rotary, apply_rope, rotate_queries).
_ROTARY_NAME = re.compile(r"rot|rope", re.IGNORECASE)

#: The last name of an expression that holds a key (``k``, ``key_states``, ``self.k(x)``, ``kT``).
_KEY_NAME = re.compile(r"^(k|kt|k_t|keys?|keys?_t|key_?states|key_?layer|keys?_?tr?|[a-z]*_(k|key|keys))$", re.IGNORECASE)


def _key_named(match: FormulaMatch) -> bool:
    """An attention match whose key is used as written (``q.matmul(k)``, k of shape
    (b, h, d, s)) is the same product as ``softmax(x @ w) @ v`` with a weight: it is
    kept only when the key operand is named like a key, or when the whole formula is
    channel-first (layout "BDS-q")."""
    if match.category != "attention" or not match.params.get("key_as_written"):
        return True
    if match.params.get("layout") == "BDS-q":
        # Channel-first values too (v @ w^T) after a query made positions-first on the
        # spot: the attention of conv feature maps (SAGAN's theta^T phi, LDM's q^T k),
        # whatever the key is called.
        return True
    text = match.inputs.get("k") or ""
    text = text.split("(", 1)[0].split("[", 1)[0].strip()
    return bool(_KEY_NAME.match(text.rsplit(".", 1)[-1]))


#: Calls that pick the largest scores (a top-k sparsified attention masks all others
#: out, so it needs the score matrix a fused attention never makes).
_TOP_SCORES = frozenset({"topk", "kthvalue"})


def _keeps_top_scores(ctx: FileContext, scope: ast.AST) -> bool:
    """Whether the function picks its top scores (fast-transformers' exact top-k
    attention: ``torch.topk(QK, k)``, then a -inf mask of all but those)."""
    key = ("formulas.top_scores", id(scope))
    found = ctx.cache.get(key)
    if found is None:
        found = ctx.cache[key] = any(
            isinstance(n, ast.Call) and (n.func.attr if isinstance(n.func, ast.Attribute) else
                                         n.func.id if isinstance(n.func, ast.Name) else "") in _TOP_SCORES
            for n in walk_scope(scope)) if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) else False
    return found


_WRAPPERS = frozenset({"cast", "dropout", "contiguous", "clone", "detach"})


def _drop_nested(found: list[FormulaMatch]) -> list[FormulaMatch]:
    """Of two matches in one scope where one tree holds the other (a formula built
    over several statements), keep the larger, unless it only wraps the smaller in a
    cast: then the smaller, which is where the math is written, stays."""
    drop: set[int] = set()
    for i, outer in enumerate(found):
        for j, inner in enumerate(found):
            if i == j or outer.scope_id != inner.scope_id or outer.tree is None or inner.tree is None:
                continue
            if inner.tree is outer.tree or not any(n is inner.tree for n in walk(outer.tree)):
                continue
            core = outer.tree
            while core.op in _WRAPPERS and core.args:
                core = core.args[0]
            drop.add(i if core is inner.tree else j)
    return [m for k, m in enumerate(found) if k not in drop]


def _has_fused_call(ctx: FileContext, scope: ast.AST, category: str, seen: dict[tuple[int, str], bool]) -> bool:
    key = (id(scope), category)
    if key not in seen:
        if isinstance(scope, ast.Module) or not hasattr(scope, "lineno"):
            text = ""
        else:
            text = "".join(ctx.lines[scope.lineno - 1 : scope.end_lineno or scope.lineno])  # type: ignore[attr-defined]
        calls = FUSED_CALLS.get(category, ())
        seen[key] = any(call in text for call in calls) or any(
            _calls_bare(text, name) for name in _imported_fused_names(ctx, calls))
    return seen[key]


def _old_torch_only(ctx: FileContext, scope: ast.AST) -> bool:
    """Whether ``scope`` is a function of the module (or a method of a class of the
    module) used only where torch is older than a version or lacks the library
    operator: ``if torch.__version__ < "1.4.0": gelu = _gelu_python`` (or the ``else``
    of a ``>=``), ``GELU = nn.GELU if hasattr(nn, "GELU") else GELU_``: a fallback
    that current torch never runs."""
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    defined = scope
    if scope not in ctx.tree.body:
        defined = next((c for c in ctx.tree.body if isinstance(c, ast.ClassDef) and scope in c.body), None)
        if defined is None:
            return False
    uses = [n for n in ctx.nodes(ast.Name) if n.id == defined.name and isinstance(n.ctx, ast.Load)]
    if not uses:
        return False
    old: list[tuple[int, int]] = []
    for node in ctx.nodes(ast.If, ast.IfExp):
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and "__version__" in ctx.text(test.left) \
                and isinstance(node, ast.If) and node in ctx.tree.body:
            body = node.body if isinstance(test.ops[0], (ast.Lt, ast.LtE)) else \
                node.orelse if isinstance(test.ops[0], (ast.Gt, ast.GtE)) else []
        elif _has_torch_attribute(ctx, test):
            body = node.orelse if isinstance(node.orelse, list) else [node.orelse]
        else:
            continue
        if body:
            old.append((body[0].lineno, body[-1].end_lineno or body[-1].lineno))
    return all(any(first <= n.lineno <= last for first, last in old) for n in uses)


def _has_torch_attribute(ctx: FileContext, test: ast.AST) -> bool:
    """``hasattr(nn, "GELU")``, ``hasattr(torch.nn.functional, "silu")``: a test of
    whether the installed torch has the operator."""
    return isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "hasattr" \
        and len(test.args) == 2 and (ctx.qualified_name(test.args[0]) or "").startswith("torch")


def _other_layout(match: Match) -> bool:
    """A norm over another dimension than the last (ConvNeXt's ``channels_first``
    branch beside ``F.layer_norm`` for ``channels_last``): the fused call in the scope
    serves the other layout, so the hand-written one is no fallback of it."""
    return match.category in ("layer_norm", "rms_norm") and match.params.get("dim", -1) != -1


#: Packages whose fused operators ``FUSED_CALLS`` names.
_FUSED_PACKAGES = ("torch.", "torch_npu.", "xformers.", "flash_attn.", "apex.")


def _imported_fused_names(ctx: FileContext, calls: tuple[str, ...]) -> list[str]:
    """Local names bound by an import to one of ``calls`` (``from torch.nn.functional
    import scaled_dot_product_attention``, ``... as sdpa``): called bare, they are the
    same fused call as ``F.scaled_dot_product_attention(``."""
    wanted = {c.strip(".(") for c in calls}
    return [local for local, origin in ctx.imports.items()
            if origin.rsplit(".", 1)[-1] in wanted and origin.startswith(_FUSED_PACKAGES) and "." in origin]


def _calls_bare(text: str, name: str) -> bool:
    """Whether ``text`` calls ``name(`` as a bare name (not ``x.name(``, not ``my_name(``)."""
    probe = name + "("
    pos = text.find(probe)
    while pos != -1:
        before = text[pos - 1] if pos else " "
        if not (before.isalnum() or before in "_."):
            return True
        pos = text.find(probe, pos + len(probe))
    return False


def load_compute() -> Any:
    """The evaluating half, imported on first use: it imports torch."""
    if "torch" not in sys.modules:
        from torchaxe.scan.formulas import fingerprints

        # torch leaves some 160,000 long-lived objects behind; without this every
        # later garbage collection walks them, and a scan of many files slows by a third.
        gc.freeze()
        return fingerprints.compute
    from torchaxe.scan.formulas.fingerprints import compute

    return compute


def _fingerprints(nodes: list[Node], categories: frozenset[str]) -> list[list[Match]]:
    """Each root's matches: none for a root whose structure rules every formula out,
    from the store when it has them; only the others are evaluated (and only then is
    torch imported)."""
    keys = [root_key(node, categories) if worth_evaluating(node, categories) else None for node in nodes]
    stored = STORE.get_many([k.key for k in keys if k is not None])
    todo: dict[str, tuple[Node, dict[str, str]]] = {}
    for node, key in zip(nodes, keys):
        if key is not None and key.key not in stored and key.key not in todo:
            todo[key.key] = (node, key.roles)
    fresh = _evaluate(todo, categories) if todo else {}
    results: list[list[Match]] = []
    for node, key in zip(nodes, keys):
        if key is None:
            results.append([])
            continue
        entry = stored.get(key.key, fresh.get(key.key))
        results.append(decode(entry, node))
    STORE.put_many(fresh)
    return results


def _evaluate(todo: dict[str, tuple[Node, dict[str, str]]], categories: frozenset[str]) -> dict[str, list]:
    """Store entries for the trees of ``todo``: from the scan's evaluator process when
    this is a worker of a parallel scan without torch, else computed here."""
    channel = remote.link()
    if channel is not None:
        entries = channel.evaluate(list(todo.values()), categories)
        if entries is not None:
            return dict(zip(todo, entries))
    compute = load_compute()
    return {k: encode(compute(node, roles, categories), node) for k, (node, roles) in todo.items()}


def _locate(ctx: FileContext, root: Root, match: Match, scope_name: str) -> FormulaMatch | None:
    node = match.node
    expr = root.made.get(id(node))
    made_here = expr is not None
    if expr is None:
        if id(node) in root.scope_made or id(node) in root.scope_inlined:
            return None  # built by another statement or by a callee: reported there
        expr = root.expr
        spread = True
    else:
        spread = not _all_made_here(node, match.inputs.values(), root.made, root.inlined_made)
    inputs: dict[str, str | None] = {}
    placed: dict[str, ast.AST] = {}
    for role, inner in match.inputs.items():
        inputs[role] = _input_text(ctx, inner, root, expr)
    fixable = not spread and all(t is not None for t in inputs.values())
    for role, inner in match.inputs.items():
        if inputs[role] is None:
            # Named elsewhere in the statement, or a parameter: good enough for the message.
            sources = root.named.get(id(inner)) or root.scope_named.get(id(inner))
            if sources:
                names = [s for s in sources if isinstance(s, ast.Name)]
                placed[role] = (names or sources)[0]
                inputs[role] = ctx.text(placed[role])
            elif inner.op == VAR and inner.value.replace(".", "").isidentifier():
                inputs[role] = inner.value
        else:
            source = next((s for s in root.named.get(id(inner), ()) if _within(s, expr)), None)
            if source is not None:
                placed[role] = source
    # What the formula does between its inputs and its result, beyond the reference:
    # a detach stops gradients the fused call would let through; a dropout before the
    # softmax drops scores, not weights.
    between = _ops_between(node, match.inputs.values())
    params = match.params
    if "cast" in between and not params.get("casts"):
        params = {**params, "casts": True}
    assumed = sorted({n.value for n in _between(node, match.inputs.values())
                      if n.op == VAR and isinstance(n.value, str) and n.value.endswith(SIZE_POWER_MARK)})
    if assumed:
        # self.scale = dim ** -0.5 read as a power of the normalised size: true only if
        # __init__ is given that size; the user checks it.
        params = {**params, "size_assumed": [a[: -len(SIZE_POWER_MARK)] for a in assumed]}
        fixable = False
    if "detach" in between or _dropout_before_softmax(node, match.inputs.values()):
        fixable, spread_ok = False, False
    else:
        spread_ok = True
    plan = None
    if spread and spread_ok and made_here and all(t is not None for t in inputs.values()) and set(placed) >= {
            r for r, i in match.inputs.items() if i.op != CONST}:
        plan = spread_plan(root.scope, expr, placed, ctx.lines, ctx.qualified_name, _class_of(ctx, root.scope))
    callees = frozenset(id(root.scope_inlined[id(n)]) for n in walk(node) if id(n) in root.scope_inlined)
    return FormulaMatch(match.category, match.reference, match.max_abs, match.max_rel, Span.of(expr), inputs,
                        params, fixable, spread, scope_name, node, id(root.scope), callees, plan)


def _between(node: Node, inputs: Any) -> Iterator[Node]:
    """The nodes of ``node`` outside its inputs' subtrees."""
    stop = {id(i) for i in inputs}
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if id(n) in stop or id(n) in seen:
            continue
        seen.add(id(n))
        yield n
        stack.extend(n.children())


def _ops_between(node: Node, inputs: Any) -> set[str]:
    return {n.op for n in _between(node, inputs)}


def _dropout_before_softmax(node: Node, inputs: Any) -> bool:
    """A dropout whose operand holds no softmax (dropout on the scores): SDPA's
    ``dropout_p`` drops weights after the softmax, another random function."""
    inputs = list(inputs)
    return any(n.op == "dropout" and not _ops_between(n, inputs) & {"softmax", "exp"}
               for n in _between(node, inputs))


def _class_of(ctx: FileContext, scope: ast.AST) -> ast.ClassDef | None:
    """The class whose body defines ``scope`` (a method), if any."""
    for node in fast_walk(ctx.tree):
        if isinstance(node, ast.ClassDef) and any(s is scope for s in node.body):
            return node
    return None


def _all_made_here(node: Node, inputs: Any, made: dict[int, ast.AST], inlined: set[int]) -> bool:
    """Whether every operation of ``node`` outside its inputs was written in this
    statement (nothing came from an inlined local or callee)."""
    stop = {id(i) for i in inputs}
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if id(n) in stop or id(n) in seen or n.op in (VAR, CONST):
            continue
        seen.add(id(n))
        if id(n) not in made and id(n) not in inlined:
            return False
        stack.extend(n.children())
    return True


def _within(inner: ast.AST, outer: ast.AST) -> bool:
    start = (inner.lineno, inner.col_offset)  # type: ignore[attr-defined]
    end = (inner.end_lineno, inner.end_col_offset)  # type: ignore[attr-defined]
    return (outer.lineno, outer.col_offset) <= start and end <= (outer.end_lineno, outer.end_col_offset)  # type: ignore[attr-defined]


def _input_text(ctx: FileContext, inner: Node, root: Root, expr: ast.AST) -> str | None:
    for source in root.named.get(id(inner), ()):
        if _within(source, expr):
            return ctx.text(source)
    if inner.op == CONST and isinstance(inner.value, (int, float)):
        return repr(inner.value)
    return None
