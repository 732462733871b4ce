"""`compile_mode: reduce-overhead` on CUDA: the compiled drafter and target layers replay as CUDA graphs
(inductor records graph trees, which the default mode does not, and skips none of them), and a short run's losses match the default mode's step for step. Skipped
without a GPU.

Run (any CUDA GPU): python3 -m pytest tests/gpu/test_compile_mode_gpu.py -q
(on a machine without pydantic add --noconftest: the shared conftest imports the settings)
"""

import math

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _losses(tmp_path, mode: str, *, target: str = "tiny:llama", steps: int = 8) -> list[float]:
    from dflash_core.train.assemble import build_trainer
    from dflash_core.train.config import TrainConfig
    from dflash_core.train.data import TokenizedCorpus

    length, samples = 64, 96
    tokens = np.random.default_rng(0).integers(1, 255, size=samples * length, dtype=np.uint32)
    mask = np.tile(np.r_[np.zeros(8, np.uint8), np.ones(length - 8, np.uint8)], samples)
    corpus = TokenizedCorpus(tokens=tokens, loss_mask=mask, offsets=np.arange(samples + 1, dtype=np.int64) * length,
                             names=("synthetic",))
    config = TrainConfig(run_name=f"graphs-{mode}", target=target, data=["synthetic"], output_dir=tmp_path / mode,
                         token_budget=256, max_steps=steps, log_every=1, upload_checkpoints=False, checkpoint_every=100,
                         compile=True, compile_mode=mode, drafter={"num_layers": 1, "block_size": 8, "num_anchors": 16})
    trainer = build_trainer(config, corpus=corpus)
    trainer.validate_capture()  # a target forward outside the loop's steps, as the pipeline's train task runs one
    records = []
    trainer.run(on_log=records.append)
    trainer.close()
    return [r["loss"] for r in records]


def _graph_trees():
    """The graphs inductor's CUDA-graph trees recorded on this GPU (none: the mode never reached inductor)."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    return {} if manager is None else dict(manager.roots)


def test_reduce_overhead_replays_graphs_with_the_default_modes_losses(tmp_path):
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    torch.manual_seed(0)
    default = _losses(tmp_path, "default")
    assert not _graph_trees()  # the default mode records none
    counters.clear()
    torch.manual_seed(0)
    graphed = _losses(tmp_path, "reduce-overhead")
    assert _graph_trees(), "reduce-overhead recorded no CUDA graph: the mode did not reach torch.compile"
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])
    assert len(graphed) == len(default) == 8 and all(math.isfinite(x) for x in graphed)
    assert graphed == pytest.approx(default, rel=2e-2)


def test_a_graphed_30_layer_target_keeps_each_layers_output(tmp_path):
    """The target runs without grad, so each compiled layer's call starts a new CUDA-graph iteration and gives
    up the last layer's output: before the layers' outputs were copied out (target_runtime.graph_outputs_owned)
    the 30-layer target's first forward raised `accessing tensor output of CUDAGraphs that has been overwritten`
    on an H200 (2026-12-05), where the 6-layer tiny target had passed."""
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    torch.manual_seed(0)
    default = _losses(tmp_path, "default", target="random:smollm2-135m", steps=4)
    torch.manual_seed(0)
    graphed = _losses(tmp_path, "reduce-overhead", target="random:smollm2-135m", steps=4)
    assert _graph_trees()
    assert graphed == pytest.approx(default, rel=2e-2)

