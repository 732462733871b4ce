"""speculators' drafter as the acceptance bench trains it on a GPU: its simple_flex_attention inside its
torch.compile'd forward, a training step (finite gradients), and the same loss as its dense sdpa path. If its
compiled flex forward failed on this torch, the bench would fall back to eager flex, torch's slow reference, and
the bench's speculators rows would crawl: this says so first. Skipped without CUDA or speculators.

Run (a GPU machine with the speculators wheel, `python -m bench.acceptance prepare` lists it):
  python -m pytest -o addopts="" -q tests/gpu/test_speculators_flex_gpu.py
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_its_compiled_flex_forward_trains_and_matches_its_dense_path(tmp_path):
    from bench.acceptance import speculators as spec

    spec.stand_in_for_missing()
    pytest.importorskip("speculators")
    from tests.unit.test_bench_acceptance_attention import save_tiny_target, speculators_step

    save_tiny_target(tmp_path)
    flex = speculators_step(tmp_path, resolve_on="cuda", run_on="cuda", compiled=True, backward=True)
    dense = speculators_step(tmp_path, resolve_on="cuda", run_on="cuda", attention="sdpa", compiled=True,
                             backward=True)
    assert (flex[0], dense[0]) == ("simple_flex_attention", "sdpa")
    assert flex[1] == pytest.approx(dense[1], rel=1e-3)
