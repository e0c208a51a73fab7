"""A stand-in for torch_npu in the tests: records the calls the npu knob and backend make
to the file named by FAKE_TORCH_NPU_LOG, one JSON object a line, and keeps the compile
mode so that is_jit_compile_false reads it back. No device."""

import json
import os


def _log(record):
    path = os.environ.get("FAKE_TORCH_NPU_LOG")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


class _Npu:
    # Like torch_npu, the mode is process-wide state that is_jit_compile_false reads back.
    _jit_compile = True

    @staticmethod
    def set_compile_mode(**kwargs):
        if "jit_compile" in kwargs:
            _Npu._jit_compile = bool(kwargs["jit_compile"])
        _log({"call": "set_compile_mode", "kwargs": kwargs})

    @staticmethod
    def is_jit_compile_false():
        _log({"call": "is_jit_compile_false"})
        return not _Npu._jit_compile

    @staticmethod
    def set_aoe(dump_path):
        # torch_npu dumps the graphs it runs from now on; the stand-in writes one at once.
        _log({"call": "set_aoe", "dump_path": dump_path})
        os.makedirs(dump_path, exist_ok=True)
        with open(os.path.join(dump_path, "graph_0.txt"), "w") as fh:
            fh.write("stand-in graph dump\n")

    @staticmethod
    def is_available():
        return False


npu = _Npu()
