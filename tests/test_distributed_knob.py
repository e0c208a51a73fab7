"""The ``ddp`` knob: DistributedDataParallel built by the script gets the knob's
settings (checked on the real DDP, gloo, one rank), the patch is undone afterwards,
and bad values are one-line errors naming the key."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchaxe.distributed.knob import SPEC, DdpKnobs
from torchaxe.errors import TorchaxeError
from torchaxe.runtime.knobs import AppliedKnobs, KnobError, KnobSet, knob_set_from_dict

SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.fixture
def group(tmp_path):
    """A one-rank gloo process group, destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _apply(raw):
    knobs = knob_set_from_dict({"ddp": raw}, "knobs.json")
    applied = AppliedKnobs(knobs)
    return knobs, applied, SPEC.patch(knobs.ddp, applied)


def _step(ddp):
    import torch

    ddp(torch.randn(4, 8)).sum().backward()


def test_the_script_s_ddp_gets_the_knob_s_settings_and_the_patch_is_undone(group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    init, register = DDP.__init__, DDP.register_comm_hook
    _, applied, patch = _apply({"bucket_cap_mb": 100, "gradient_as_bucket_view": True, "static_graph": True,
                                "find_unused_parameters": False, "broadcast_buffers": False, "comm_hook": "fp16"})
    with patch:
        assert DDP.__init__ is not init
        # The script passes find_unused_parameters=True by name and nothing else.
        ddp = DDP(_model(), find_unused_parameters=True)
        for _ in range(2):
            _step(ddp)
        data = ddp._get_ddp_logging_data()
    assert DDP.__init__ is init and DDP.register_comm_hook is register
    assert ddp.static_graph is True
    assert ddp.gradient_as_bucket_view is True
    assert ddp.find_unused_parameters is False
    assert ddp.broadcast_buffers is False
    assert data["bucket_cap_bytes"] == 100 * 1024 * 1024
    assert data["comm_hook"] == "fp16_compress_hook"
    record = applied.record["ddp"]
    assert record["instances"] == 1
    changed = record["modules"][0]["changed"]
    assert changed["find_unused_parameters"] == {"from": True, "to": False}
    assert changed["bucket_cap_mb"] == {"from": 25, "to": 100}
    assert changed["comm_hook"]["to"] == "fp16_compress_hook"
    assert record["modules"][0]["module"] == "Sequential"
    # After the run a DDP is built as the script says.
    plain = DDP(_model(), find_unused_parameters=True)
    assert plain.find_unused_parameters is True and plain.static_graph is False
    assert plain._get_ddp_logging_data()["bucket_cap_bytes"] == 25 * 1024 * 1024


def test_arguments_given_by_position_are_overridden_too(group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    _, applied, patch = _apply({"broadcast_buffers": True})
    with patch:
        # module, device_ids, output_device, dim, broadcast_buffers by position
        ddp = DDP(_model(), None, None, 0, False)
    assert ddp.broadcast_buffers is True
    assert applied.record["ddp"]["modules"][0]["changed"] == {"broadcast_buffers": {"from": False, "to": True}}


@pytest.mark.parametrize("knob, script, kept", [
    # The knob's hook is registered at construction: the script's own, later, is skipped.
    ("fp16", "allreduce_hook", "fp16_compress_hook"),
    # "none": the script's own hook is skipped, DDP all-reduces in full precision.
    ("none", "fp16_compress_hook", None),
])
def test_a_hook_the_script_registers_itself_is_skipped_not_fatal(group, knob, script, kept):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    _, applied, patch = _apply({"comm_hook": knob})
    with patch:
        ddp = DDP(_model())
        ddp.register_comm_hook(None, getattr(default_hooks, script))
        _step(ddp)
    assert (ddp._get_ddp_logging_data().get("comm_hook") or None) == kept
    assert applied.record["ddp"]["skipped_script_hooks"] == [script]


def test_a_hook_ddp_refuses_here_is_one_line(group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    # DDP takes the bf16 hook only with CUDA and NCCL (or XPU): not on gloo.
    _, _, patch = _apply({"comm_hook": "bf16"})
    with patch, pytest.raises(TorchaxeError, match=r"^ddp.comm_hook bf16: DistributedDataParallel refused "
                                                   r"bf16_compress_hook here: .*NCCL") as caught:
        DDP(_model())
    assert "\n" not in str(caught.value)


def test_a_keyword_this_torch_lacks_is_left_out_in_one_line(group, monkeypatch, capsys):
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    real = DDP.__init__
    signature = inspect.signature(real)
    # An older torch: no static_graph, and broadcast_buffers not yet replaced by forward_sync_buffers.
    older = signature.replace(parameters=[p for n, p in signature.parameters.items()
                                          if n not in ("static_graph", "forward_sync_buffers")])

    def __init__(self, *args, **kwargs):
        return real(self, *args, **kwargs)

    __init__.__signature__ = older
    monkeypatch.setattr(DDP, "__init__", __init__)
    monkeypatch.setenv("RANK", "0")
    _, applied, patch = _apply({"static_graph": True, "bucket_cap_mb": 50, "broadcast_buffers": False})
    with patch, pytest.warns(FutureWarning, match="broadcast_buffers"):
        ddp = DDP(_model())
    assert ddp.static_graph is False and ddp.bucket_bytes_cap == 50 * 1024 * 1024
    assert ddp.broadcast_buffers is False
    assert applied.record["ddp"]["unsupported"] == ["static_graph"]
    assert applied.record["ddp"]["modules"][0]["changed"]["broadcast_buffers"] == {"from": True, "to": False}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no DistributedDataParallel keyword static_graph: left out" in err[0]


@pytest.mark.parametrize("value, message", [
    ({"bucket_cap_mb": 0}, "ddp.bucket_cap_mb: expected a positive number of megabytes, got number 0"),
    ({"bucket_cap_mb": "25"}, "ddp.bucket_cap_mb: expected a positive number"),
    ({"bucket_cap_mb": True}, "ddp.bucket_cap_mb: expected a positive number"),
    ({"static_graph": "yes"}, "ddp.static_graph: expected true or false"),
    ({"comm_hook": "powersgd"}, 'ddp.comm_hook: "powersgd" is not one of bf16, fp16, none'),
    ({"bucket_size": 25}, "ddp.bucket_size: unknown key"),
    ([], "ddp: expected an object"),
])
def test_bad_values_are_one_line_errors_naming_the_key(value, message):
    with pytest.raises(KnobError) as caught:
        knob_set_from_dict({"ddp": value}, "knobs.json")
    text = str(caught.value)
    assert text.startswith("knobs.json: ") and message in text and "\n" not in text


def test_the_value_reads_back_as_written():
    raw = {"bucket_cap_mb": 12.5, "gradient_as_bucket_view": True, "static_graph": True,
           "find_unused_parameters": False, "broadcast_buffers": False, "comm_hook": "bf16"}
    knobs = knob_set_from_dict({"name": "x", "ddp": raw}, "knobs.json")
    assert knobs.ddp == DdpKnobs(**raw)
    assert knobs.to_dict() == {"name": "x", "ddp": raw}
    assert KnobSet(name="x").ddp == DdpKnobs()


def test_parsing_imports_no_torch():
    code = ("import sys; from torchaxe.runtime.knobs import knob_set_from_dict; "
            "knob_set_from_dict({'ddp': {'static_graph': True, 'comm_hook': 'fp16'}}, 'k'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(SRC)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


SCRIPT = """
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)), find_unused_parameters=True)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(int(os.environ.get("STEPS", "6"))):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
print("static_graph", model.static_graph, "find_unused", model.find_unused_parameters, flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_bootstrap_applies_the_knob_to_a_script_s_ddp(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    knobs = tmp_path / "knobs.json"
    knobs.write_text(json.dumps({"name": "ddp", "ddp": {"static_graph": True, "find_unused_parameters": False,
                                                       "bucket_cap_mb": 50}}))
    out = tmp_path / "profile.json"
    env = {**os.environ, "PYTHONPATH": str(SRC), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "torchaxe.runtime.bootstrap", str(knobs), "--out", str(out), "--steps", "3",
         "--warmup", "1", "--target", "cpu", "--", "python", str(script)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    profile = json.loads(out.read_text())
    applied = profile["run"]["options"]["knobs"]["ddp"]
    assert applied["instances"] == 1
    assert applied["requested"] == {"bucket_cap_mb": 50, "static_graph": True, "find_unused_parameters": False}
    assert applied["modules"][0]["changed"] == {
        "bucket_cap_mb": {"from": 25, "to": 50}, "static_graph": {"from": False, "to": True},
        "find_unused_parameters": {"from": True, "to": False}}
