"""The Ascend NPU backend. The only module outside the rules' npu replacements that
imports ``torch_npu``; always lazily. Unverified on Ascend hardware."""

from __future__ import annotations

import importlib

from torchaxe.backends.base import Backend


def _torch_npu():
    return importlib.import_module("torch_npu")


class NpuBackend(Backend):
    name = "npu"
    optimizer_device = "npu"
    unverified_on_hardware = True

    def is_available(self) -> bool:
        try:
            _torch_npu()
            import torch

            return bool(torch.npu.is_available())
        except Exception:  # torch_npu missing, or installed without a driver
            return False

    def synchronize(self) -> None:
        _torch_npu()
        import torch

        torch.npu.synchronize()

    def is_initialized(self) -> bool:
        # torch_npu mirrors torch.cuda's API (torch.npu.is_initialized); a process
        # that never imported torch_npu cannot have used the device.
        import sys

        if "torch_npu" not in sys.modules:
            return False
        import torch

        check = getattr(torch.npu, "is_initialized", None)
        return bool(check()) if check is not None else True

    def reset_peak_memory(self) -> None:
        _torch_npu()
        import torch

        torch.npu.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int | None:
        _torch_npu()
        import torch

        return int(torch.npu.max_memory_allocated())

    # Device-side op times on the NPU come from torch_npu.profiler output, read by
    # trace import; torch.profiler here records the host side only.

    def device_name(self) -> str | None:
        # torch.npu.get_device_name(device=None), as torch.cuda's: e.g. "Ascend910B2".
        # Unverified on Ascend hardware.
        _torch_npu()
        import torch

        return str(torch.npu.get_device_name())

    def device_module(self):
        # torch_npu registers torch.npu, which mirrors torch.cuda's stream API
        # (Stream, current_stream, stream, Event). Unverified on Ascend hardware.
        _torch_npu()
        import torch

        return torch.npu

    def device_locations(self, root="/", environ=None, vendor_tool=None) -> list:
        # sysfs PCI scan plus `npu-smi info -t topo` (vendor_tool returns its text;
        # by default the tool is run when root is "/" and it is installed). No
        # torch_npu import. Unverified on Ascend hardware.
        import os

        from torchaxe.backends.pci import ascend_locations

        if vendor_tool is None and str(root) == "/":
            vendor_tool = _npu_smi_topo
        text = vendor_tool() if vendor_tool is not None else None
        return ascend_locations(root, os.environ if environ is None else environ, text)


def _npu_smi_topo() -> str | None:
    """The text of ``npu-smi info -t topo``, or None when the tool is missing or fails."""
    import shutil
    import subprocess

    tool = shutil.which("npu-smi")
    if tool is None:
        return None
    try:
        done = subprocess.run([tool, "info", "-t", "topo"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def set_compile_mode(jit_compile: bool) -> None:
    """Turn the NPU's online operator compilation on or off for this process
    (``torch_npu.npu.set_compile_mode(jit_compile=...)``); the trials' ``npu`` knob.
    On for fixed shapes usually pays off, off for dynamic shapes. Unverified on
    Ascend hardware: tested against a stand-in ``torch_npu`` that records the call."""
    torch_npu = _torch_npu()
    torch_npu.npu.set_compile_mode(jit_compile=bool(jit_compile))


def is_jit_compile_false() -> bool:
    """Whether online compilation is off (``torch_npu.npu.is_jit_compile_false()``:
    True after ``set_compile_mode(jit_compile=False)``, when the precompiled binary
    kernels are used). Unverified on Ascend hardware: tested against the stand-in."""
    return bool(_torch_npu().npu.is_jit_compile_false())


def jit_compile_enabled() -> bool | None:
    """The compile mode in effect: True (online compilation), False (binary kernels),
    or None where torch_npu is missing or too old to say."""
    try:
        return not is_jit_compile_false()
    except (ImportError, AttributeError):
        return None


# ---------------------------------------------------------------- AOE (auto-tuning)
# torch_npu dumps the operator graphs a process runs to a folder once
# ``torch_npu.npu.set_aoe(folder)`` is called; the CANN ``aoe`` tool then tunes them
# (``--job_type=2``: operator tuning) and writes its results to the custom knowledge
# base that the operator compiler reads on later runs. Unverified on Ascend
# hardware: tested against a stand-in torch_npu and a stand-in ``aoe``.

#: Where ``aoe`` keeps operator tuning results unless ``TUNE_BANK_PATH`` says otherwise.
AOE_DEFAULT_BANK = "~/Ascend/latest/data/aoe/custom/op"


def aoe_available() -> str | None:
    """None when AOE can run here; otherwise why not, in a few words."""
    import shutil

    try:
        torch_npu = _torch_npu()
    except Exception:  # torch_npu missing, or installed without a driver
        return "torch_npu is not installed"
    if not hasattr(getattr(torch_npu, "npu", None), "set_aoe"):
        return "this torch_npu has no npu.set_aoe"
    if shutil.which("aoe") is None:
        return "the CANN `aoe` tool is not on PATH"
    return None


def aoe_dump(folder: str) -> None:
    """Make torch_npu dump the graphs it runs from now on into ``folder``."""
    _torch_npu().npu.set_aoe(str(folder))


def aoe_knowledge_base() -> str:
    """The folder of AOE's custom operator knowledge base."""
    import os

    return os.environ.get("TUNE_BANK_PATH") or os.path.expanduser(AOE_DEFAULT_BANK)


def run_aoe(folder: str, runner=None, timeout: float | None = None):
    """Run ``aoe --job_type=2 --model_path=FOLDER`` (operator tuning of the dumped
    graphs); returns the completed process. ``runner`` replaces ``subprocess.run``."""
    import subprocess

    run = runner or subprocess.run
    return run(["aoe", "--job_type=2", f"--model_path={folder}"], capture_output=True, text=True, timeout=timeout,
               check=False)
