"""The terminal summary of ``torchaxe advise``: the top recommendations with their
measured gains and accuracy cost, the environment checks, what to run next."""

from __future__ import annotations

from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from torchaxe.advise.recommendation import Advice, Recommendation
from torchaxe.advise.where import describe
from torchaxe.runtime.candidate import MEMORY_KINDS, loss_checked
from torchaxe.units import bytes_text, duration, mfu_sentence, package_path, plural


def one_time_text(seconds: float, break_even: int | None, compiles: bool = True, first: float | None = None,
                  cold_only: bool = False) -> str:
    """A change's one-time cost (compiling, or another start-up such as loader
    workers') and when the job has paid it back. ``first``: what its first run paid,
    filling torch's compile caches; ``cold_only``: the cost is known from that run
    alone."""
    why = ["compiling"] if compiles else []
    if first:
        why.append(f"{first:.1f} s the first time on a machine, before torch's compile caches hold its kernels")
    elif cold_only:
        why.append("measured on its first run, which filled torch's compile caches: a later run here may pay less")
    text = f"costs {seconds:.1f} s once, in its first steps" + (f" ({'; '.join(why)})" if why else "")
    return text + (f"; pays off after {break_even:,} steps" if break_even else "")


def change_once_text(rec: Recommendation) -> str:
    """A measured change's one-time cost (``one_time_text``); empty when none."""
    if rec.status != "measured" or not rec.one_time_seconds:
        return ""
    return one_time_text(rec.one_time_seconds, rec.break_even_steps, compiles(rec), rec.one_time_seconds_first,
                         rec.one_time_cold_only)


def chosen_once_text(advice: Advice) -> str:
    """The chosen changes' one-time cost (a change chosen alone, its own); empty when none."""
    combined = advice.combined or {}
    if combined.get("status") != "measured" or not combined.get("one_time_seconds"):
        return ""
    return one_time_text(combined["one_time_seconds"], combined.get("break_even_steps"),
                         first=combined.get("one_time_seconds_first"),
                         cold_only=bool(combined.get("one_time_cold_only")))


def job_text(advice: Advice) -> str | None:
    """What the chosen changes together save over the whole job, when its length is
    known: the steps' time saved less the one-time costs, beside the steps' time now.
    The run's start-up and its work outside the steps are not in it."""
    job, combined = advice.job or {}, advice.combined or {}
    saved, step = combined.get("measured_seconds_saved_per_step"), advice.baseline.get("step_seconds_median")
    if not job.get("steps") or not saved or not step:
        return None
    steps = job["steps"]
    net = steps * saved - (combined.get("one_time_seconds") or 0.0)
    return (f"over the job's {steps:,} steps ({job.get('source')}): about {duration(net)} saved of "
            f"{duration(steps * step)} in steps, one-time costs counted; the run's start-up and its work "
            f"outside the steps stay as they are, so the whole run gains less")


def compiles(rec: Recommendation) -> bool:
    """Whether a change compiles (its one-time cost is compiling): torch.compile, a
    tuned subgraph, the NPU's online compilation."""
    knobs = rec.knobs or {}
    return bool(knobs.get("compile") or knobs.get("tune") or (knobs.get("npu") or {}).get("jit_compile")
                or rec.axis == "compile")


def together_text(together: dict) -> str:
    """Why one change was kept alone: what the changes first chosen did together."""
    keys = together.get("keys") or []
    first = f"the {len(keys)} changes first chosen ({', '.join(keys)})"
    if together.get("speedup"):
        return f"{first} measured {together['speedup']:.2f}x together"
    if together.get("status") == "failed":
        return f"{first} failed together" + (f": {together['error']}" if together.get("error") else "")
    return f"{first} were not measured together: the --budget ended before a round of them (out of --budget)"


#: The width of the report when it is not shown on a terminal (a log, a pipe), and the
#: least width on a terminal.
REPORT_WIDTH = 110


def report_width(out: TextIO, width: int | None = None) -> int:
    """``width`` if given; a terminal's own width (at least :data:`REPORT_WIDTH`);
    else :data:`REPORT_WIDTH`."""
    if width:
        return width
    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        import shutil

        return max(REPORT_WIDTH, shutil.get_terminal_size((REPORT_WIDTH, 24)).columns)
    return REPORT_WIDTH


def render_advice_text(advice: Advice, out: TextIO, top: int = 10, width: int | None = None) -> None:
    console = Console(file=out, width=report_width(out, width), highlight=False, soft_wrap=False)

    def say(markup: str, more: int | None = None) -> None:
        _say(console, markup, more)

    base = advice.baseline
    console.print(f"[bold]torchaxe advise[/bold] {escape(' '.join(advice.command))}  (target {advice.target})",
                  soft_wrap=True)
    peak, limit = base.get("peak_memory_bytes"), advice.memory_limit
    if base.get("over_memory_limit"):
        say(f"  [red]the original exceeds --memory-limit:[/red] peak {bytes_text(peak)} above "
            f"{bytes_text(limit)}; only changes that fit are chosen")
    profiled = "trial runs" not in str(base.get("source") or "trial runs")
    say(f"  original step time  median {duration(base.get('step_seconds_median'), 2)}"
        + (f", data wait {base['data_wait_fraction']:.1%}" if base.get("data_wait_fraction") is not None
           else "")
        # Not measured in trial runs: the profiled run's, slowed by its op recording.
        + (" (the profiled run's, with op recording on some steps: slower than the script runs)"
           if profiled else ""))
    if peak is not None:
        say(f"  original peak memory {bytes_text(peak)} ({MEMORY_KINDS.get(base.get('memory_kind'), 'n/a')})"
            + (f", --memory-limit {bytes_text(limit)}" if limit is not None else ""))
    mfu = advice.mfu
    if mfu is not None:
        before = mfu_sentence(mfu["before"]["mfu_table"], mfu["before"]["mfu_measured"])
        after = mfu["after"]
        after_text = ""
        if after is not None:
            after_text = "; with the chosen changes " + (mfu_sentence(after["mfu_table"], after["mfu_measured"])
                                                          or "n/a").removeprefix("MFU ")
        over = max(mfu["before"].get("mfu_measured") or 0.0, (after or {}).get("mfu_measured") or 0.0) > 1.0
        say(f"  {before}{after_text}" + (" (above 100% of the measured peak: the FLOP count holds work the "
                                        "steps did not do, and the MFU figures are not reliable)"
                                        if over else ""))
    if advice.distributed:
        _render_ranks(console, advice)
    if base.get("run_to_run_noise") is not None:
        say(f"  run-to-run noise   {base['run_to_run_noise']:.1%} (the furthest the original strayed from "
            "itself in a round: a change is chosen when it is faster by more than that in every round, or "
            "when its rounds rank below the original-against-itself rounds beyond chance)", 21)
    if base.get("loss_tolerance") is not None:
        noise = base.get("loss_noise")
        if noise is None:
            why = ("no training loss in the original's runs" if "trial runs" in str(base.get("source") or "")
                   else "the original's runs did not fit the budget")
            say(f"  loss noise         not recorded ({why})")
        else:
            same = base.get("loss_noise_same_seed")
            own = f"; its own runs, same seed: {same:.2%}" if same is not None else ""
            say(f"  loss noise         {noise:.2%} (the original's runs, one under another seed{own}); "
                f"changes to the numerics are chosen within it + {base['loss_tolerance']:.1%}", 21)
    if advice.partial:
        unmeasured = sum(1 for r in advice.recommendations
                         if r.status == "not_measured" and r.not_measured_reason == "budget")
        what = (f"{plural(unmeasured, 'change')} not measured for the --budget" if unmeasured else
                "not every planned run was made: some figures rest on fewer rounds")
        say(f"  [yellow]partial advice:[/yellow] {what} (see the notes below)")
    ranked = advice.ranked()
    if ranked:
        table = Table(title="Recommendations, by measured time saved per step", title_justify="left",
                      show_lines=False, pad_edge=False, box=None)
        table.add_column("#", justify="right")
        table.add_column("change", overflow="fold", ratio=1)
        table.add_column("saved/step", justify="right", no_wrap=True)
        table.add_column("speedup", justify="right", no_wrap=True)
        table.add_column("memory", justify="right", no_wrap=True)
        table.add_column("accuracy", overflow="fold", max_width=20)
        table.add_column("status", overflow="fold", max_width=20)
        for n, rec in enumerate(ranked[:top], 1):
            saved = duration(rec.measured_seconds_saved_per_step, 2) if rec.status == "measured" else "-"
            speedup = f"{rec.speedup:.2f}x" if rec.speedup else "-"
            status = ("* " if rec.selected else "") + rec.status
            if rec.held_back:
                status += ", held back"
            if rec.status == "failed" and rec.error:
                status += " (why: below)"
            kind = (f"[{rec.applies}{', unsafe' if rec.unsafe else ''}"
                    f"{', changes the optimisation' if rec.changes_optimisation else ''}] ")
            memory = rec.memory.text.removesuffix(" memory") if rec.memory and rec.status == "measured" else "-"
            where = f"\n  [dim]{package_path(rec.location)}[/dim]" if rec.location else ""
            if rec.applied_to:
                where += f"\n  [dim]{rec.applied_to} (the modules with parameters the loop itself called)[/dim]"
            once = change_once_text(rec)
            if once:
                where += f"\n  [dim]{once}[/dim]"
            accuracy = rec.accuracy.text if rec.accuracy.kind != "unknown" or rec.status == "measured" else "-"
            table.add_row(str(n), kind.replace("[", "\\[") + rec.title.replace("[", "\\[") + where, saved, speedup,
                          memory, accuracy, status)
        console.print(table)
        if len(ranked) > top:
            say(f"  ... {len(ranked) - top} more in --format json or html")
        if any(r.selected for r in ranked):
            say("  * chosen: faster beyond the run-to-run noise; together below")
        if any(r.memory for r in ranked[:top]):
            say("  memory: the change of the peak memory against the original's, measured in the same "
                "rounds (-35%: 35% less)" + ("; ~: no more than the runs' own peaks differ from one "
                                             "another" if any(r.memory and r.memory.within_noise
                                                              for r in ranked[:top]) else ""))
        failed = [r for r in ranked[:top] if r.status == "failed" and r.error]
        if failed:
            # In full: a status column cut to its width hides what the user must fix.
            say("  failed:")
            for r in failed:
                lines = [line.strip() for line in r.error.splitlines() if line.strip()]
                say(f"    {r.key}: {lines[0] if lines else ''}".replace("[", "\\["))
        held = [r for r in ranked[:top] if r.held_back]
        if held:
            say("  held back (not chosen, yours to decide):")
            for r in held:
                _hanging(console, f"{r.key}: {r.held_back}", 4, 6)
        if any(r.changes_optimisation for r in ranked[:top]):
            say("  changes the optimisation: a larger micro-batch, ranked by samples per second; fewer "
                "optimizer steps per epoch, so check convergence before keeping it")
    combined = advice.combined
    if combined:
        together = combined.get("together")
        if combined.get("status") == "measured" and together:
            # The set was cut to its best change: its own figure, and what the set measured.
            rounds = len(combined.get("ratios") or [])
            say(f"[bold]Chosen alone:[/bold] {', '.join(combined.get('keys') or [])}, "
                f"{combined['speedup']:.2f}x faster in its own {rounds} round{'s' if rounds != 1 else ''} "
                f"({duration(combined.get('measured_seconds_saved_per_step'), 2)} saved per step); "
                f"{together_text(together)}")
        elif combined.get("status") == "measured":
            say(f"[bold]All chosen changes together:[/bold] {combined['speedup']:.2f}x faster "
                f"({duration(combined.get('measured_seconds_saved_per_step'), 2)} saved per step), measured "
                "interleaved with the original")
        if combined.get("status") == "measured":
            once = chosen_once_text(advice)
            if once:
                say("  " + once)
            job = job_text(advice)
            if job:
                say("  " + job)
        else:
            say(f"All chosen changes together: {combined.get('status')} {combined.get('error') or ''}")
    if advice.achieved:
        a = advice.achieved
        if a.get("speedup"):
            rounds = ", ".join(f"{1 / r:.2f}x" for r in a.get("ratios") or [] if r)
            say(f"[bold]Gain achieved since `torchaxe apply`:[/bold] {a['speedup']:.2f}x, the median of "
                f"the interleaved rounds ({rounds}); step medians over all rounds: now "
                f"{duration(a.get('step_seconds_median'), 2)}, "
                f"original {duration(a.get('original_step_seconds_median'), 2)}")
        elif a.get("error"):
            say(f"Gain achieved since `torchaxe apply`: not measured ({a['error']})")
        if a.get("where"):
            say("  where it came from (the original files and the script now, each profiled once):")
            for item in a["where"]:
                say(f"    {describe(item)}")
        if a.get("where_note"):
            say(f"  {a['where_note']}")
    if advice.environment:
        say("[bold]Environment checks[/bold]")
        by_key = {r.key: r for r in advice.recommendations}
        for check in advice.environment:
            where = f" ({check.location})" if check.location else ""
            say(f"  - {check.name}: {check.message}{where}{_measured_text(by_key.get(check.recommendation))}")
    installed = advice.scanned.get("installed_findings") or []
    if installed:
        ran = [i for i in installed if i.get("executed", True)]
        if len(ran) == len(installed):
            which = ""
        elif ran:
            which = f", {len(ran)} in code its steps ran (listed first; the others left out, see the note)"
        else:
            which = ", none in code its steps ran (left out, see the note)"
        say(f"  {plural(len(installed), 'finding')} in installed packages the run imported{which} "
            "(all of them in the JSON advice, scanned.installed_findings):")
        installed = ran + [i for i in installed if not i.get("executed", True)]
        for item in installed[:3]:
            say(f"    {package_path(str(item.get('path')))}:{item.get('line')} {item.get('code')} "
                f"{item.get('category', '').replace('_', ' ')}")
        if len(installed) > 3:
            say(f"    ... {len(installed) - 3} more")
    for note in advice.notes:
        _hanging(console, f"note: {note}", 2, 4)
    say("[bold]Next[/bold]")
    chosen = [r for r in ranked if r.selected]
    if any(r.applies == "code" for r in chosen):
        verdicts = [loss_checked(r.to_dict()) for r in chosen if r.applies == "code" and r.unsafe]
        unsafe, checked = not all(verdicts), any(verdicts)
        say("  torchaxe apply --diff" + (" --unsafe-fixes" if unsafe else "")
            + "   (shows the changes; without --diff it makes them"
            + (", --unsafe-fixes takes the fixes that may change numerics too" if unsafe else "")
            + ("; the unsafe fixes chosen with their loss checked here are applied without it"
               if checked and unsafe else
               "; the unsafe fixes chosen are applied: their loss was checked on this run" if checked
               else "") + ")")
    elif any(r.applies == "knob" for r in chosen):
        say("  torchaxe apply   (writes the knobs to torchaxe.toml)")
    if chosen:
        console.print("  torchaxe run -- " + " ".join(advice.command), markup=False, soft_wrap=True)
    else:
        say("  nothing measured clearly faster; see the table for what was tried")
    measured = [r for r in advice.recommendations if r.status == "measured"]
    tried = [r for r in advice.recommendations if r.status in ("measured", "failed", "not_measured")]
    rounds = max((len(r.ratios or []) for r in measured), default=0)
    spent = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in advice.phases.items() if seconds >= 1)
    say(f"  ({advice.elapsed_seconds:.0f} s of a {advice.budget_seconds:.0f} s budget"
        + (f": {spent}" if spent else "") + "; "
        f"{len(measured)} of {len(tried)} changes measured"
        + (f", in up to {rounds} interleaved round{'s' if rounds != 1 else ''} each)" if measured else ")"))


def _say(console: Console, markup: str, more: int | None = None) -> None:
    """A line of the report (rich markup) wrapped between words at the report's width,
    its continuation lines indented past the line's own indent (by ``more`` columns in
    all when given), so that a sentence written to a file or a narrow terminal still
    reads as one item. A word longer than the width (a path) is kept whole."""
    import textwrap

    text = Text.from_markup(markup)
    plain = text.plain
    lead = len(plain) - len(plain.lstrip(" "))
    more = lead + 2 if more is None else more
    if len(plain) <= console.width or console.width - more < 30 or "\n" in plain:
        console.print(text, soft_wrap=True)
        return
    pieces, cursor = [], 0
    for n, line in enumerate(textwrap.wrap(plain, width=console.width, subsequent_indent=" " * more,
                                           break_long_words=False, break_on_hyphens=False)):
        words = line if n == 0 else line[more:]
        start = plain.find(words, cursor)
        if start < 0:  # not a piece of the line as written (textwrap changed a space): unwrapped
            console.print(text, soft_wrap=True)
            return
        cursor = start + len(words)
        pieces.append(text[start:cursor] if n == 0 else Text(" " * more) + text[start:cursor])
    for piece in pieces:
        console.print(piece, soft_wrap=True)


def _hanging(console: Console, text: str, indent: int, more: int) -> None:
    """``text`` (plain, no markup) after ``indent`` spaces, wrapped as :func:`_say`
    wraps a line, its lines after the first at ``more`` columns."""
    _say(console, escape(" " * indent + text), more)


def _ms(value: float | None) -> str:
    return duration(value, 1, missing="-")


def _render_ranks(console: Console, advice: Advice) -> None:
    """Where each rank's step went (the profiled run), the rank the others wait for
    and why, and, when changes were chosen, each rank under them."""
    view = advice.distributed or {}
    nodes = f", {view['nnodes']} node(s)" if view.get("nnodes") else ""
    grouped = view.get("process_group") is not False
    if grouped:
        console.print(f"  distributed        {view.get('world_size')} ranks{nodes}, backend {view.get('backend') or '?'}; "
                      f"a step takes the slowest rank's time")
    else:
        _hanging(console, f"  distributed        {view.get('world_size')} ranks{nodes} started by the launcher, and "
                 "the script sets up no process group: each rank trains its own copy of the model alone (no "
                 "gradient exchange, no rank waits for another); call torch.distributed.init_process_group and "
                 "wrap the model in DistributedDataParallel for the ranks to train one model together", 2, 21)
    after = {r["rank"]: r for r in (advice.combined or {}).get("ranks") or []}
    table = Table(box=None, pad_edge=False, title_justify="left")
    columns = ("rank", "host", "step", "data wait", "comm", "comm exposed") + (("waits for slowest",) if grouped else ())
    for name in columns:
        table.add_column(name, justify="left" if name == "host" else "right", no_wrap=True)
    if after:
        table.add_column("comm exposed, chosen", justify="right", no_wrap=True)
    for row in view.get("ranks") or []:
        wait = row.get("data_wait_fraction")
        cells = [str(row["rank"]), str(row.get("host") or "-"), _ms(row.get("step_seconds_median")),
                 "-" if wait is None else f"{wait:.1%}", _ms(row.get("comm_seconds_per_step")),
                 _ms(row.get("comm_exposed_seconds_per_step"))]
        if grouped:
            cells.append(_ms(row.get("wait_for_slowest_seconds_per_step")))
        if after:
            cells.append(_ms((after.get(row["rank"]) or {}).get("comm_exposed_seconds_per_step")))
        table.add_row(*cells)
    console.print(table)
    if view.get("slowest_rank") is not None:
        console.print(f"  slowest rank {view['slowest_rank']}: {view.get('slowest_reason')}")


def _measured_text(rec) -> str:
    """What the change an environment check points at measured, so the check and the
    table agree (a thread count the check calls idle may measure slower)."""
    if rec is None or rec.status != "measured" or not rec.speedup:
        return ""
    verdict = "chosen" if rec.selected else "not chosen"
    return f"; {rec.key} measured {rec.speedup:.2f}x, {verdict}"
