"""speculators' drafter as bench_acceptance trains it on a GPU from session 28 on: its simple_flex_attention inside
its torch.compile'd forward, a training step (finite gradients), and the same loss as its dense sdpa path. If its
compiled flex forward failed on this torch, the bench would fall back to eager flex, torch's slow reference, and
the acceptance call's speculators rows would crawl: this says so first. Skipped without CUDA or speculators.

Run (device machine; bench/gpu_call_acceptance_step.sh runs it when .carry/acceptance/b is carried):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/acceptance/b/whl/*.whl
  PYTHONPATH=/tmp/site python3 -m pytest -o addopts="" --noconftest -q tests/gpu/test_speculators_flex_gpu.py
"""

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_its_compiled_flex_forward_trains_and_matches_its_dense_path(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        import acceptance_speculators as spec

        spec.stand_in_for_missing()
        pytest.importorskip("speculators")
        from tests.unit.test_bench_acceptance_attention import save_tiny_target, speculators_step

        save_tiny_target(tmp_path)
        flex = speculators_step(tmp_path, resolve_on="cuda", run_on="cuda", compiled=True, backward=True)
        dense = speculators_step(tmp_path, resolve_on="cuda", run_on="cuda", attention="sdpa", compiled=True,
                                 backward=True)
    finally:
        sys.path.remove(str(BENCH))
    assert (flex[0], dense[0]) == ("simple_flex_attention", "sdpa")
    assert flex[1] == pytest.approx(dense[1], rel=1e-3)
