"""vLLM serves our DFlash export (both formats) for the embedded SmolLM2, drafting every round, and every drafted
output equals the target-only server's: the served stage's measurement (dflash_core/evaluate/served.py) end to end.
Skipped without CUDA or without vLLM's interpreter in DFLASH_VLLM_PYTHON (the node's vllm-venv).

Run (a GPU node set up by infra/node-install.sh with the vLLM parts):
  DFLASH_VLLM_PYTHON=/tmp/dflash-node/vllm-venv/bin/python python3 -m pytest tests/gpu/test_served_gpu.py -q --noconftest
"""

import os
import warnings

import pytest
import torch

VLLM_PYTHON = os.environ.get("DFLASH_VLLM_PYTHON")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not VLLM_PYTHON,
                                reason="needs a CUDA GPU and DFLASH_VLLM_PYTHON (vLLM's interpreter)")


@pytest.mark.parametrize("export_format", ["native", "speculators"])
def test_vllm_drafts_with_our_export_and_keeps_the_targets_outputs(tmp_path, export_format):
    from transformers import AutoConfig

    from dflash_core.embedded import embedded_model_dir
    from dflash_core.evaluate.served import compare_served, serve_and_measure
    from dflash_core.export import export_drafter
    from dflash_core.export.engines import speculative_config
    from dflash_core.model import DFlashConfig
    from dflash_core.model.build import build_drafter
    from dflash_core.serving.profiles import VllmProfile

    target_dir = str(embedded_model_dir(tmp_path / "models"))
    target_config = AutoConfig.from_pretrained(target_dir)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drafter = build_drafter(DFlashConfig.from_target(target_config, num_layers=1, block_size=8))
    export = export_drafter(drafter, target_config=target_config, out_dir=tmp_path / "export",
                            verifier_name_or_path=target_dir, formats=(export_format,), dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, target_config.vocab_size, (n,), generator=generator).tolist() for n in (9, 33, 20)]
    engine = {"model": target_dir, "python": VLLM_PYTHON, "dtype": "bfloat16", "max_model_len": 1024,
              "gpu_memory_utilization": 0.3, "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"}}
    measure = {"port": 8470, "device": "0", "prompts": prompts, "max_new_tokens": 24, "concurrencies": [1, 3]}
    spec = speculative_config(export[export_format])
    assert spec["num_speculative_tokens"] == 7
    target_only = serve_and_measure(VllmProfile(**engine), run_dir=tmp_path / "target-only", **measure)
    drafted = serve_and_measure(VllmProfile(**engine, speculative_config=spec), run_dir=tmp_path / "drafter",
                                **measure)
    served = compare_served(target_only, drafted)
    assert served["all_outputs_equal"], served["rows"]
    assert all(row["drafts"] > 0 for row in served["rows"]) and served["tau"] >= 1.0
    assert all(p.counters.drafts == 0 for p in target_only)  # a target-only server counts no rounds
