"""A stand-in for torch_npu in the trial tests: records the calls the npu knob makes
to the file named by FAKE_TORCH_NPU_LOG, one JSON object a line. No device."""

import json
import os


class _Npu:
    @staticmethod
    def set_compile_mode(**kwargs):
        with open(os.environ["FAKE_TORCH_NPU_LOG"], "a") as fh:
            fh.write(json.dumps({"call": "set_compile_mode", "kwargs": kwargs}) + "\n")

    @staticmethod
    def is_available():
        return False


npu = _Npu()
