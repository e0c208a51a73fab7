"""The shapes report: one dict (the ``--format json`` output, schema
``torchaxe.shapes/1``) and its text rendering, made from that dict so that the two
cannot disagree."""

from __future__ import annotations

import json
from typing import Any, Sequence, TextIO

from torchaxe.shapes.analysis import MAX_LISTED, ShapeAnalysis
from torchaxe.shapes.verdict import Verdict
from torchaxe.units import duration

SCHEMA = "torchaxe.shapes/1"
NPU_NOTE = "npu recommendations and the npu compile-mode setters are unverified on Ascend hardware"


def _listed(analysis: ShapeAnalysis, kind: str) -> list[dict[str, Any]]:
    dynamic = [s for s in analysis.of_kind(kind) if s.dynamic]
    dynamic.sort(key=lambda s: (-max((d.distinct for d in s.dims), default=0), -s.distinct, s.name))
    return [s.to_dict() for s in dynamic[:MAX_LISTED]]


def build_report(*, command: Sequence[str] | None, target: str, verdict: Verdict, analysis: ShapeAnalysis | None,
                 source: str = "run", steps: int | None = None, max_shapes: int | None = None,
                 warnings: Sequence[str] = (), trial: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None) -> dict[str, Any]:
    recs = sorted(verdict.recommendations, key=lambda r: (r.target != target, ))
    out: dict[str, Any] = {
        "schema": SCHEMA,
        "source": source,
        "command": list(command) if command else None,
        "target": target,
        "steps": steps if steps is not None else (analysis.steps if analysis else None),
        "verdict": verdict.verdict,
        "reasons": list(verdict.reasons),
        "pick": verdict.picks.get(target),
        "picks": dict(verdict.picks),
        "recommendations": [r.to_dict() for r in recs],
        "max_shapes": max_shapes,
    }
    if analysis is not None:
        out["counts"] = {"ops": analysis.counts("op"), "modules": analysis.counts("module")}
        out["dynamic"] = {"ops": _listed(analysis, "op"), "modules": _listed(analysis, "module"),
                          "batches": [s.to_dict() for s in analysis.of_kind("batch") if s.dynamic]}
        out["causes"] = [c.to_dict() for c in analysis.causes]
        out["data_dependent"] = [s.to_dict() for s in analysis.sites if s.kind != "item"] + \
            [s.to_dict() for s in analysis.sites if s.kind == "item"
             and any(c.location == s.location and c.kind == "item" for c in analysis.causes)]
        out["loaders"] = [l.to_dict() for l in analysis.loaders]
    out["bucketing"] = [b.to_dict() for b in verdict.buckets]
    out["trial"] = trial
    out["warnings"] = list(warnings)
    out["notes"] = [NPU_NOTE]
    if extra:
        out.update(extra)
    return out


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, allow_nan=False) + "\n"


def _sizes(dim: dict[str, Any]) -> str:
    return f"{dim['distinct']} sizes {dim['min']}..{dim['max']}"


def _where(d: dict[str, Any]) -> str:
    return f"{d['position']} dim {d['dim']}" if d["dim"] is not None else f"{d['position']} (number of tensors)"


def render_text(report: dict[str, Any], out: TextIO) -> None:
    w = out.write
    what = " ".join(report["command"]) if report.get("command") else report.get("source", "")
    w(f"shapes: {what}\n")
    if report.get("steps") is not None:
        n = report["steps"]
        w(f"  {n} step{'s' if n != 1 else ''} recorded; target {report['target']}\n")
    w(f"\nverdict: {report['verdict'].upper()}\n")
    for reason in report["reasons"]:
        w(f"  - {reason}\n")
    counts = report.get("counts")
    if counts:
        o, m = counts["ops"], counts["modules"]
        w(f"\n  operators  {o['total']:>4}  ({o['static']} one shape, {o['dynamic']} several)\n")
        w(f"  modules    {m['total']:>4}  ({m['static']} one shape, {m['dynamic']} several)\n")
    causes = {c["id"]: c for c in report.get("causes", [])}
    dynamic = report.get("dynamic") or {}
    rows = []
    for kind in ("batches", "modules", "ops"):
        for subject in dynamic.get(kind, []):
            for d in subject["dims"][:3]:
                cause = causes.get(d["cause"] or "")
                rows.append((subject["kind"], subject["name"], _where(d), _sizes(d),
                             cause["kind"] if cause else "unknown"))
            if not subject["dims"]:
                rows.append((subject["kind"], subject["name"], "inputs change in number or rank",
                             f"{subject['distinct']} shape sets", ", ".join(subject["causes"]) or "unknown"))
    if rows:
        w("\nvarying dimensions (cause: see below)\n")
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        shown = rows[:40]
        for r in shown:
            w("  " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r[:4])) + f"  {r[4]}\n")
        if len(rows) > len(shown):
            w(f"  ... {len(rows) - len(shown)} more (--format json lists them)\n")
        for batch in dynamic.get("batches", []):
            for d in batch["dims"]:
                dist = ", ".join(f"{size} x{n}" for size, n in list(d["distribution"].items())[:16])
                more = " ..." if len(d["distribution"]) > 16 else ""
                w(f"  distribution of {batch['name']} {_where(d)}: {dist}{more}\n")
    if causes:
        w("\ncauses\n")
        for c in causes.values():
            where = f" [{c['location']}]" if c.get("location") else ""
            w(f"  {c['kind']}{where}: {c['message']}\n")
            if c.get("code"):
                w(f"      {c['code']}\n")
            if c.get("fix"):
                w(f"      fix: {c['fix']}\n")
    for b in report.get("bucketing", []):
        where = f" ({b['location']})" if b.get("location") else ""
        dims = ", ".join(str(d) for d in b["dims"])
        name = f" ({b['field']})" if b.get("field") else ""
        w(f"\nbucketing: tensor {b['tensor']}{name} of {b['collate_fn']}{where}'s batches, dim {dims}; "
          f"{b['current_shapes']} shapes now\n")
        w("  K  shapes  extra padding  boundaries\n")
        for plan in b["table"]:
            bounds = "; ".join(", ".join(str(v) for v in dim) for dim in plan["boundaries"])
            mark = "  <- --max-shapes" if plan["k"] == b["chosen"]["k"] else ""
            w(f"  {plan['k']}  {plan['shapes']:>6}  {100 * plan['extra_padding']:>+12.1f}%  {bounds}{mark}\n")
        w(f"  use: {b['snippet']}\n")
    recs = report["recommendations"]
    if recs:
        w(f"\nrecommendations (target {report['target']} first; pick: {report.get('pick') or 'measure'})\n")
        for r in recs:
            w(f"  {r['target']:<4}  {r['kind']:<14} {r['setting']}\n")
            w(f"        {r['reason']}\n")
    trial = report.get("trial")
    if trial:
        _render_trial(trial, w)
    for warning in report.get("warnings", []):
        w(f"\nwarning: {warning}\n")
    for note in report.get("notes", []):
        w(f"note: {note}\n")


def _render_trial(trial: dict[str, Any], w) -> None:
    w(f"\nmeasured (--try): {trial['repeats']} round(s) interleaved; first {trial['warmup_steps']} steps = "
      f"compile/warm-up, then {trial['steps']} steady-state steps; ratio = steady median / "
      f"{trial['baseline']}'s, per round\n")
    rows = [("candidate", "status", "warm-up", "overhead", "steady median", "p90", "ratio (min..max)")]
    for c in trial["candidates"]:
        if not c["ok"]:
            rows.append((c["name"], "FAILED", "", "", "", "", ""))
            continue
        ratio = c.get("ratio")
        ratio_text = (f"{ratio['median']:.3f} ({ratio['min']:.3f}..{ratio['max']:.3f})" if ratio and
                      ratio["median"] is not None else "n/a")
        if c["name"] == trial["baseline"]:
            ratio_text = "1.00 (baseline)"
        steady = c["steady"]
        rows.append((c["name"], "ok" + (" noisy" if steady["noisy"] else ""), duration(c["warmup"]["seconds_median"]),
                     duration(c["warmup"]["overhead_seconds"]), duration(steady["median"]), duration(steady["p90"]),
                     ratio_text))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        w("  " + "  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() + "\n")
    if trial.get("winner"):
        margin = trial.get("winner_over_runner_up")
        by = f", {100 * (1 - margin):.1f}% faster than the runner-up" if margin else ""
        w(f"  winner (steady state): {trial['winner']}{by}\n")
        if trial.get("payback_steps") is not None:
            w(f"  its extra compile cost over {trial['baseline']} is paid back after "
              f"{trial['payback_steps']:.0f} steps\n")
    if trial.get("pick"):
        within = trial.get("pick_within")
        verdict = ("the winner" if within is not None and within <= 1e-12 else
                   f"{100 * within:.1f}% slower than the winner" if within is not None else "not measured")
        w(f"  the verdict's pick, {trial['pick']}, is {verdict}\n")
    for c in trial["candidates"]:
        if not c["ok"]:
            w(f"  {c['name']} failed: {c['error']}\n")
