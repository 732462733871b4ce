"""`transformers serve` as a GPU node's engine (dflash_core/serving/profiles.py): the CUDA flags it gets,
and an interpreter resolved where the stage runs, not where the form was filled.

Run: .venv/bin/python -m pytest -q -n 0 tests/unit/test_engine_profiles_gpu.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_core.serving.profiles import TransformersProfile, VllmProfile


def test_cuda_profile_asks_for_the_device_dtype_and_a_kv_share_per_instance():
    profile = TransformersProfile(model="/dev/shm/m", device="cuda", dtype="bfloat16", continuous_batching=True,
                                  cb_memory_fraction=0.2)
    argv = profile.argv(port=8100)
    assert argv[argv.index("--device") + 1] == "cuda"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--cb-max-memory-percent") + 1] == "0.2"
    assert "--continuous-batching" in argv
    assert profile.instance_env("0") == {"CUDA_VISIBLE_DEVICES": "0"}
    assert profile.instance_env("cpu") == {}


def test_cpu_default_keeps_its_flags():
    argv = TransformersProfile(model="/m").argv(port=8100)
    assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--dtype") + 1] == "auto"
    assert "--no-continuous-batching" in argv and "--cb-max-memory-percent" not in argv


def test_the_interpreter_is_the_stage_process_own_unless_the_form_names_one():
    profile = TransformersProfile.model_validate(json.loads(TransformersProfile(model="/m").model_dump_json()))
    assert profile.python is None  # a dumped form carries no interpreter of the machine that filled it
    assert profile.argv(port=1)[0] == str(Path(sys.executable).parent / "transformers")
    pinned = VllmProfile(model="/m", python="/opt/vllm/bin/python")
    assert pinned.argv(port=1)[0] == "/opt/vllm/bin/python"
