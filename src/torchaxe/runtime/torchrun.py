"""Training commands launched with torchrun: read them, and run torchaxe in every rank.

A user types the job as they run it::

    torchrun --nproc-per-node 8 train.py ARGS
    python -m torch.distributed.run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py ARGS

:func:`parse_job` takes such a command apart into torchrun's own options (kept as
typed, so rendezvous, ``--standalone``, ``--max-restarts`` and every other option
work as users know them) and the command each rank runs, in ``python`` form
(``python train.py ARGS`` or ``python -m pkg.train ARGS``), which the harness
understands. A plain ``python train.py`` gives a job without torchrun.

:meth:`Job.launch` is torchrun with a torchaxe module in front of the rank's script
(the trial bootstrap, or a torchaxe verb): every rank is measured the same way, and
torchrun still starts, watches and ends the ranks. torchrun's argument parser says
which of its options take a value, so the script is the first token that is neither
an option nor an option's value.

Imports nothing heavy: torch (for torchrun's parser) only when a torchrun command is
read.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from torchaxe.errors import TorchaxeError

#: torchrun options that say how to run the script; torchaxe's module takes over.
HOW_FLAGS = {"-m": "module", "--module": "module", "--no-python": "exec", "--no_python": "exec",
             "--run-path": "script", "--run_path": "script"}
#: The module that is torchrun (``python -m torch.distributed.run``).
TORCHRUN_MODULE = "torch.distributed.run"
#: Set in the ranks of a verb run in every rank: a verb whose exit code states a
#: verdict (``data``: 1 = data-bound) exits 0 there, since torchrun takes any other
#: code for a failed rank and stops the others.
IN_RANKS = "TORCHAXE_IN_RANKS"


def rank_exit_code(code: int, verdicts: tuple[int, ...] = (1,)) -> int:
    """``code``, or 0 for a verdict code in a rank of a verb run in every rank."""
    return 0 if code in verdicts and os.environ.get(IN_RANKS) == "1" else code


@dataclass
class LaunchArgs:
    """A torchrun command line taken apart (and the options of a torchaxe verb that
    stood among torchrun's, for ``torchaxe launch``)."""

    own: dict[str, Any] = field(default_factory=lambda: {"cpus": []})
    torchrun: list[str] = field(default_factory=list)
    script: str = ""
    script_args: list[str] = field(default_factory=list)
    how: str = "script"


def torchrun_parser():
    """torchrun's own argument parser, so that exactly its options are accepted."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def error(message: str):
        raise TorchaxeError(f"torchrun option: {message}")

    parser.error = error  # type: ignore[method-assign]
    return parser


def split_args(tokens: Sequence[str], parser=None, own_options: Mapping[str, bool] | None = None) -> LaunchArgs:
    """Separate torchrun's options, the script and its arguments (and, with
    ``own_options`` — name -> takes a value — a torchaxe verb's options among them)."""
    parser = parser or torchrun_parser()
    own_options = own_options or {}
    takes_value = {opt: action.nargs != 0 for action in parser._actions for opt in action.option_strings}
    out = LaunchArgs()
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, inline = token.partition("=")
        if name in own_options:
            i = _own_option(out, tokens, i, name, eq, inline, own_options[name])
            continue
        if token == "--":
            i += 1
            break
        if token.startswith("-") and token != "-":
            if name in ("--numa-binding", "--numa_binding") and own_options:
                raise TorchaxeError("--numa-binding is torchrun's binding (CUDA only, needs numactl): "
                                    "use torchaxe's --bind MODE instead")
            if name in HOW_FLAGS:
                out.how = HOW_FLAGS[name]
                i += 1
                continue
            if name not in takes_value:
                raise TorchaxeError(f"unknown option {name} (not a torchrun option; "
                                    "options for the script go after it)")
            out.torchrun.append(token)
            if takes_value[name] and not eq:
                if i + 1 >= len(tokens):
                    raise TorchaxeError(f"torchrun option {name} needs a value")
                out.torchrun.append(tokens[i + 1])
                i += 2
            else:
                i += 1
            continue
        break
    if i >= len(tokens):
        raise TorchaxeError("no training script after torchrun's options: `torchrun [options] train.py ARGS`")
    out.script = tokens[i]
    out.script_args = tokens[i + 1:]
    return out


def _own_option(out: LaunchArgs, tokens: list[str], i: int, name: str, eq: str, inline: str, valued: bool) -> int:
    if not valued:
        out.own[name[2:].replace("-", "_")] = True
        return i + 1
    if eq:
        value, i = inline, i + 1
    elif i + 1 < len(tokens):
        value, i = tokens[i + 1], i + 2
    else:
        raise TorchaxeError(f"{name} needs a value")
    key = name[2:].replace("-", "_")
    if key == "cpus":
        out.own["cpus"].append(value)
    elif key in out.own:
        raise TorchaxeError(f"{name} given twice")
    else:
        out.own[key] = value
    return i


def torchrun_tokens(argv: Sequence[str]) -> list[str] | None:
    """What follows the launcher in ``torchrun ARGS`` or ``python -m
    torch.distributed.run ARGS``; None for any other command."""
    tokens = list(argv)
    if not tokens:
        return None
    head = os.path.basename(tokens[0])
    if head in ("torchrun", "torchrun.exe"):
        return tokens[1:]
    from torchaxe.runtime.command import is_python, split_module, split_python

    if not is_python(tokens[0]):
        return None
    options, rest = split_python(tokens)
    module = split_module(rest)
    if module is None:
        return None
    name, args = module
    if name == TORCHRUN_MODULE:
        return args
    if name == "torch.distributed.launch":
        raise TorchaxeError("torch.distributed.launch is deprecated: give the same job as `torchrun [options] "
                            "train.py ARGS` (torchrun sets LOCAL_RANK in the environment instead of --local-rank)")
    return None


@dataclass(frozen=True)
class Job:
    """The training job: one process (``torchrun is None``), or torchrun's ranks."""

    #: The command one process runs, in ``python`` form (what the harness reads).
    script_argv: tuple[str, ...]
    #: torchrun's options as typed (without ``--module`` / ``--no-python``); None: no torchrun.
    torchrun: tuple[str, ...] | None = None
    #: The whole command as typed.
    typed: tuple[str, ...] = ()

    @property
    def distributed(self) -> bool:
        return self.torchrun is not None

    def launch(self, module_argv: Sequence[str]) -> list[str]:
        """The command that runs ``python -m MODULE_ARGV... -- SCRIPT`` in every rank:
        torchrun (this interpreter's) with that module in front of the script; the
        module's own command line without torchrun for a one-process job."""
        module, *rest = module_argv
        if self.torchrun is None:
            return [sys.executable, "-m", module, *rest, "--", *self.script_argv]
        return [sys.executable, "-m", TORCHRUN_MODULE, *self.torchrun, "--module", module, *rest, "--",
                *self.script_argv]

    def option(self, *names: str) -> str | None:
        """The value of one of torchrun's options as typed (last one wins), else None."""
        found = None
        tokens = list(self.torchrun or ())
        for i, token in enumerate(tokens):
            name, eq, inline = token.partition("=")
            if name in names:
                found = inline if eq else (tokens[i + 1] if i + 1 < len(tokens) else None)
        return found

    @property
    def nnodes(self) -> int:
        """The number of nodes (the lower bound of an elastic ``MIN:MAX``); 1 without torchrun."""
        text = self.option("--nnodes") or "1"
        try:
            return int(text.split(":")[0])
        except ValueError:
            raise TorchaxeError(f"--nnodes {text}: expected N or MIN:MAX") from None


def parse_job(argv: Sequence[str]) -> Job:
    """The job of a typed command: ``torchrun [options] SCRIPT ARGS`` (or ``python -m
    torch.distributed.run ...``), else a one-process ``python`` command. Raises
    TorchaxeError, in one line, for a torchrun command whose rank command is not a
    Python script or module."""
    tokens = torchrun_tokens(argv)
    if tokens is None:
        return Job(tuple(argv), None, tuple(argv))
    args = split_args(tokens)
    if args.how == "module":
        script = ("python", "-m", args.script, *args.script_args)
    elif args.how == "exec":
        from torchaxe.runtime.command import is_python

        if not is_python(args.script):
            raise TorchaxeError(f"torchrun --no-python {args.script}: torchaxe measures Python training scripts; "
                                "give `torchrun [options] train.py ARGS`")
        script = (args.script, *args.script_args)
    else:
        script = ("python", args.script, *args.script_args)
    return Job(script, tuple(args.torchrun), tuple(argv))


def parse_script(argv: Sequence[str], cwd: str | None = None):
    """The job of ``argv`` and the script each of its processes runs (a
    ``command.ScriptCommand``), with the one-line errors of either."""
    from torchaxe.runtime.command import parse_command

    job = parse_job(argv)
    return job, parse_command(job.script_argv, cwd=cwd)


def verb_in_ranks(raw_args: Sequence[str], command: Sequence[str]) -> list[str] | None:
    """For ``torchaxe VERB [options] -- torchrun [options] SCRIPT ARGS``: torchrun
    running ``torchaxe VERB [options] -- python SCRIPT ARGS`` in every rank (the form
    the verb works in under torchrun); None when ``command`` is no torchrun job.
    ``raw_args``: the verb and everything after it, as typed."""
    job = parse_job(command)
    if job.torchrun is None:
        return None
    raw = list(raw_args)
    cut = len(raw) - len(command)
    if cut < 1 or raw[cut:] != list(command):
        raise TorchaxeError("cannot tell the training command from torchaxe's options: put it after `--`")
    own = raw[:cut]
    if own[-1:] == ["--"]:
        own = own[:-1]
    return [sys.executable, "-m", TORCHRUN_MODULE, *job.torchrun, "--module", "torchaxe", *own, "--",
            *job.script_argv]


#: How much of torchrun's stderr (its ranks' included) is kept to name the failed rank.
STDERR_TAIL_BYTES = 64 << 10


def _pass_on(stream: Any, tail: bytearray) -> None:
    """Copy ``stream`` to this process's stderr as it comes, keeping its last
    :data:`STDERR_TAIL_BYTES` in ``tail``."""
    out = getattr(sys.stderr, "buffer", None)
    while True:
        chunk = os.read(stream.fileno(), 1 << 14)
        if not chunk:
            break
        if out is not None:
            out.write(chunk)
            out.flush()
        else:
            sys.stderr.write(chunk.decode("utf-8", "replace"))
            sys.stderr.flush()
        tail += chunk
        del tail[:-STDERR_TAIL_BYTES]


def failure_line(verb: str, code: int, stderr_tail: str) -> str:
    """The one line that ends a failed torchrun job: the rank that failed first, as
    torchrun names it, and what its exit code means when it is one of torchaxe's."""
    failure = torchrun_failure(stderr_tail)
    if failure is None:
        return f"torchaxe {verb}: error: torchrun exited with code {code}"
    match = re.search(r"ended with exit code (-?\d+)", failure)
    meaning = RANK_EXIT_CODES.get(int(match.group(1))) if match else None
    return f"torchaxe {verb}: error: {failure}" + (f" ({meaning})" if meaning and meaning not in failure else "")


#: What a rank's exit code says when torchaxe's verb ended it (docs: profile's exit codes).
RANK_EXIT_CODES = {2: "a usage error", 3: "the script raised", 4: "the script exited with a non-zero code",
                   5: "the run timed out", 6: "no training step was seen"}


def run_verb_in_ranks(raw_args: Sequence[str] | None, command: Sequence[str]) -> int | None:
    """Run the verb in every rank of a torchrun job (see :func:`verb_in_ranks`) and
    return torchrun's exit code; None when ``command`` is no torchrun job. Ctrl-C
    reaches torchrun, which stops its ranks. torchrun's stderr (its ranks' too) is
    passed on as it comes; when the job fails, a last line names the rank that failed
    first and why."""
    import subprocess
    import threading

    if raw_args is None:
        if parse_job(command).torchrun is None:
            return None
        raise TorchaxeError("run torchaxe from its command line to give it a torchrun command")
    argv = verb_in_ranks(raw_args, command)
    if argv is None:
        return None
    from torchaxe.runtime.command import check_module

    check_module(parse_script(command)[1])  # one-line errors before torchrun starts anything
    sys.stderr.write(f"torchaxe: running in every rank: {' '.join(argv[2:])}\n")
    sys.stderr.flush()
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, env={**os.environ, IN_RANKS: "1"})
    tail = bytearray()
    reader = threading.Thread(target=_pass_on, args=(process.stderr, tail), daemon=True)
    reader.start()
    while True:
        try:
            code = process.wait()
            reader.join(timeout=5.0)  # a process torchrun left behind may hold the pipe open
            break
        except KeyboardInterrupt:
            continue
    if code != 0:
        verb = raw_args[0] if raw_args else ""
        sys.stderr.write(failure_line(verb, code, bytes(tail).decode("utf-8", "replace")) + "\n")
        sys.stderr.flush()
    return code


def torchrun_failure(stderr: str) -> str | None:
    """The first failed rank as torchrun's failure summary names it ("Root Cause"):
    ``rank 1 (local_rank 1) ended with exit code -9: Signal 9 (SIGKILL) received by
    PID 123``; None when the text holds no such summary."""
    root = stderr.rfind("Root Cause")
    if root < 0:
        return None
    text = stderr[root:]
    rank = re.search(r"^\s*rank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?", text, re.MULTILINE)
    code = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", text, re.MULTILINE)
    cause = re.search(r"^\s*traceback\s*:\s*(.+)$", text, re.MULTILINE)
    if rank is None:
        return None
    who = f"rank {rank.group(1)}" + (f" (local rank {rank.group(2)})" if rank.group(2) else "")
    what = f" ended with exit code {code.group(1)}" if code else " failed"
    why = cause.group(1).strip() if cause else ""
    if why.startswith("To enable traceback"):
        why = ""
    return f"{who}{what}" + (f": {why}" if why else "")


def in_ranks(command: Sequence[str]) -> None:
    """A verb given a torchrun command (``torchaxe VERB -- torchrun ... train.py``)
    runs itself in every rank and exits with torchrun's code; otherwise returns."""
    from torchaxe.console import raw_args

    code = run_verb_in_ranks(raw_args(), list(command))
    if code is not None:
        sys.exit(code)
