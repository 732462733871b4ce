"""A server that runs out of GPU memory while starting is named as such, with the settings to change
(dflash_core/serving/launcher.py).

Run: .venv/bin/python -m pytest -q -n 0 tests/unit/test_engine_failures.py
"""

from __future__ import annotations

from dflash_core.serving.launcher import EngineOutOfMemory, named_failure
from dflash_core.serving.profiles import SglangProfile, VllmProfile
from dflash_core.services.process import ServiceError

# vLLM 0.26.0's own message (vllm/v1/core/kv_cache_utils.py) when the KV cache does not fit, as a log tail quotes it.
VLLM_KV_CACHE = ("vllm-0 exited before it was ready (log /w/server-0.log):\nValueError: To serve at least one request "
                 "with the model's max seq len (32768), (4.0 GiB KV cache is needed, which is larger than the "
                 "available KV cache memory (1.2 GiB).")


def test_a_kv_cache_that_does_not_fit_is_out_of_memory_with_vllms_knobs():
    error = named_failure(ServiceError(VLLM_KV_CACHE), VllmProfile(model="/m"))
    assert isinstance(error, EngineOutOfMemory) and isinstance(error, ServiceError)
    assert "lower gpu_memory_utilization or max_model_len" in str(error) and "log /w/server-0.log" in str(error)


def test_torchs_oom_names_sglangs_knobs_and_other_failures_pass_through():
    oom = ServiceError("sglang-0 exited before it was ready:\ntorch.OutOfMemoryError: CUDA out of memory. Tried to ...")
    assert "mem_fraction_static or context_length" in str(named_failure(oom, SglangProfile(model="/m")))
    other = ServiceError("vllm-0 exited before it was ready:\nModuleNotFoundError: No module named 'pydantic'")
    assert named_failure(other, VllmProfile(model="/m")) is other
