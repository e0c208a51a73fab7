"""The ``ddp`` knob: DistributedDataParallel's settings for every DDP module the script
builds, without editing the script::

    {"ddp": {"bucket_cap_mb": 100, "gradient_as_bucket_view": true, "static_graph": true,
             "find_unused_parameters": false, "broadcast_buffers": false, "comm_hook": "bf16"}}

Every key is optional. While the script runs, ``DistributedDataParallel.__init__`` is
patched (:class:`DdpOverride`): each construction's arguments are bound to torch's own
signature (whether the script passed them by position, by name or not at all) and the
knob's values replace them before torch's ``__init__`` runs. The patch is undone when
the run ends. Under torchrun the bootstrap runs in every rank, so every rank's DDP gets
the same settings, as DDP requires.

``broadcast_buffers``: where this torch has ``forward_sync_buffers`` (which replaces
it), that keyword is set instead: buffers are then still synced once at construction
and no longer before every forward. ``comm_hook``: ``"bf16"`` or ``"fp16"`` registers
torch's ``bf16_compress_hook`` / ``fp16_compress_hook`` (gradients all-reduced in 16
bits, with the DDP's process group as the hook's state) right after construction; a
hook the script registers itself on that module afterwards is then skipped, with a
note, instead of failing (DDP takes one hook). ``"none"``: the script's own hook
registrations are skipped, so DDP all-reduces in full precision.

A keyword this torch's DDP does not take is left out, in one line on stderr (rank 0)
and in the record. Parsing imports nothing heavy (knob files are read before torch is
imported); torch is imported when the patch is installed.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from torchaxe.errors import TorchaxeError
from torchaxe.runtime.knobs import AppliedKnobs, Knob, KnobCheck, installed, kind

#: The DDP keywords the knob sets, besides ``comm_hook``.
KEYWORDS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters",
            "broadcast_buffers")
#: ``comm_hook`` values: torch's gradient compression hooks, or none at all.
COMM_HOOKS = ("bf16", "fp16", "none")
#: The hook each ``comm_hook`` value registers (torch.distributed.algorithms.ddp_comm_hooks.default_hooks).
HOOK_FUNCTIONS = {"bf16": "bf16_compress_hook", "fp16": "fp16_compress_hook"}
#: How many DDP modules the record describes one by one (the count covers them all).
RECORDED_MODULES = 8
#: DDP's keyword that replaced ``broadcast_buffers`` in newer torch.
FORWARD_SYNC = "forward_sync_buffers"
#: What DDP does with a keyword given as None (the default of newer torch).
NONE_MEANS = {"bucket_cap_mb": 25, "broadcast_buffers": True}


@dataclass(frozen=True)
class DdpKnobs:
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool | None = None
    static_graph: bool | None = None
    find_unused_parameters: bool | None = None
    broadcast_buffers: bool | None = None
    #: "bf16", "fp16" or "none".
    comm_hook: str | None = None

    def keywords(self) -> dict[str, Any]:
        """The DDP constructor keywords the knob sets (``comm_hook`` is not one)."""
        return {k: getattr(self, k) for k in KEYWORDS if getattr(self, k) is not None}

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _say(line: str) -> None:
    """One line on stderr, from the first rank only (every rank applies the same knob)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"torchaxe: {line}", file=sys.stderr, flush=True)


class DdpOverride:
    """Patches ``DistributedDataParallel.__init__`` (and ``register_comm_hook``) so that
    every DDP the script builds gets the knob's settings, and records what changed."""

    def __init__(self, knobs: DdpKnobs, applied: AppliedKnobs) -> None:
        self.knobs = knobs
        self.applied = applied
        self.count = 0
        self.modules: list[dict[str, Any]] = []
        self.unsupported: list[str] = []
        self.skipped_hooks: list[str] = []
        self._originals: tuple[Any, Any] | None = None
        #: DDP modules whose hook the knob decides (registered by it, or "none").
        self._ours: weakref.WeakSet[Any] = weakref.WeakSet()

    def _record(self) -> None:
        record: dict[str, Any] = {"requested": self.knobs.to_dict(), "instances": self.count,
                                  "modules": self.modules}
        if self.unsupported:
            record["unsupported"] = self.unsupported
        if self.skipped_hooks:
            record["skipped_script_hooks"] = self.skipped_hooks
        self.applied.note("ddp", record)

    def install(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            self.unsupported = list(self.knobs.to_dict())
            _say("ddp: torch.distributed is not available in this torch build: the ddp knob does nothing")
            self._record()
            return
        from torch.nn.parallel import DistributedDataParallel

        original_init = DistributedDataParallel.__init__
        original_register = DistributedDataParallel.register_comm_hook
        self._originals = (original_init, original_register)
        signature = inspect.signature(original_init)
        parameters = signature.parameters
        wanted = self.knobs.keywords()
        self.unsupported = [k for k in wanted if k not in parameters
                            and not (k == "broadcast_buffers" and FORWARD_SYNC in parameters)]
        if self.unsupported:
            import torch

            _say(f"ddp: this torch ({torch.__version__}) has no DistributedDataParallel keyword "
                 f"{', '.join(self.unsupported)}: left out")
        override = self

        def __init__(ddp, *args, **kwargs):
            try:
                bound = signature.bind(ddp, *args, **kwargs)
            except TypeError:  # torch says what is wrong with the call
                return original_init(ddp, *args, **kwargs)
            changed = override.edit(bound.arguments, parameters)
            original_init(*bound.args, **bound.kwargs)
            override.constructed(ddp, changed)

        def register_comm_hook(ddp, state, hook):
            if ddp in override._ours:
                name = getattr(hook, "__qualname__", None) or repr(hook)
                override.skipped_hooks.append(name)
                override._record()
                return None
            return original_register(ddp, state, hook)

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        register_comm_hook.__wrapped__ = original_register  # type: ignore[attr-defined]
        DistributedDataParallel.__init__ = __init__
        DistributedDataParallel.register_comm_hook = register_comm_hook
        self._record()

    def uninstall(self) -> None:
        if self._originals is not None:
            from torch.nn.parallel import DistributedDataParallel

            DistributedDataParallel.__init__, DistributedDataParallel.register_comm_hook = self._originals
            self._originals = None

    def edit(self, arguments: dict[str, Any], parameters: Any) -> dict[str, dict[str, Any]]:
        """Put the knob's keywords into one construction's bound ``arguments``; return
        what changed (keyword -> {"from": ..., "to": ...})."""
        changed: dict[str, dict[str, Any]] = {}

        def before(name: str) -> Any:
            if name in arguments:
                return arguments[name]
            default = parameters[name].default
            return None if default is inspect.Parameter.empty else default

        for name, value in self.knobs.keywords().items():
            if name in self.unsupported:
                continue
            if name == "broadcast_buffers" and FORWARD_SYNC in parameters:
                # Newer torch: forward_sync_buffers replaces it (and still syncs the
                # buffers once at construction, which broadcast_buffers=False did not).
                script = arguments.get("broadcast_buffers")
                old = arguments.get(FORWARD_SYNC, script if script is not None else True)
                if script is False and FORWARD_SYNC not in arguments and value is False:
                    continue  # the script already turned every sync off
                arguments.pop("broadcast_buffers", None)
                arguments[FORWARD_SYNC] = value
                if old != value:
                    changed["broadcast_buffers"] = {"from": old, "to": value}
                continue
            old = before(name)
            if old is None:
                old = NONE_MEANS.get(name)
            arguments[name] = value
            if old != value:
                changed[name] = {"from": old, "to": value}
        return changed

    def constructed(self, ddp: Any, changed: dict[str, dict[str, Any]]) -> None:
        """After torch's ``__init__``: register the knob's comm hook, record the module."""
        hook = self.knobs.comm_hook
        if hook in HOOK_FUNCTIONS:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            function = getattr(default_hooks, HOOK_FUNCTIONS[hook])
            try:
                self._originals[1](ddp, ddp.process_group, function)  # type: ignore[index]
            except (TypeError, RuntimeError, ValueError) as exc:
                raise TorchaxeError(f"ddp.comm_hook {hook}: DistributedDataParallel refused "
                                    f"{HOOK_FUNCTIONS[hook]} here: {str(exc).strip().splitlines()[0]}") from None
            changed["comm_hook"] = {"from": None, "to": HOOK_FUNCTIONS[hook]}
        if hook is not None:
            self._ours.add(ddp)
        self.count += 1
        if len(self.modules) < RECORDED_MODULES:
            self.modules.append({"module": type(getattr(ddp, "module", None)).__qualname__, "changed": changed})
        self._record()


class DdpKnob(Knob):
    """``ddp``: DistributedDataParallel's bucket size, bucket views, static graph,
    unused-parameter search, buffer sync and gradient compression hook."""

    key = "ddp"
    example = {"bucket_cap_mb": 100, "static_graph": True, "comm_hook": "fp16"}

    def default(self) -> DdpKnobs:
        return DdpKnobs()

    def parse(self, raw: Any, check: KnobCheck) -> DdpKnobs:
        d = check.obj(raw, "ddp", (*KEYWORDS, "comm_hook"))
        cap = d.get("bucket_cap_mb")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0
                                or not math.isfinite(cap)):
            check.fail("ddp.bucket_cap_mb", f"expected a positive number of megabytes, got {kind(cap)}")
        return DdpKnobs(
            bucket_cap_mb=cap,
            gradient_as_bucket_view=check.bool(d.get("gradient_as_bucket_view"), "ddp.gradient_as_bucket_view"),
            static_graph=check.bool(d.get("static_graph"), "ddp.static_graph"),
            find_unused_parameters=check.bool(d.get("find_unused_parameters"), "ddp.find_unused_parameters"),
            broadcast_buffers=check.bool(d.get("broadcast_buffers"), "ddp.broadcast_buffers"),
            comm_hook=check.choice(d.get("comm_hook"), "ddp.comm_hook", COMM_HOOKS),
        )

    def patch(self, value: DdpKnobs, applied: AppliedKnobs):
        return installed(DdpOverride(value, applied)) if value.to_dict() else nullcontext()


SPEC = DdpKnob()
