"""The hybrid bench's profile helpers (the bench itself needs a GPU for its figures)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "bench_hybrid_step.py"
_SPEC = importlib.util.spec_from_file_location("bench_hybrid_step", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


def test_gpu_idle_counts_only_time_no_kernel_ran():
    kernels = [(0, 10, "a"), (5, 20, "b"), (20, 30, "c"), (1030, 1040, "d"), (1100, 1200, "e"), (1150, 1160, "f")]
    span, idle, gaps = bench.gpu_idle(kernels)
    assert span == 1200
    assert idle == 1000 + 60  # 30 -> 1030 and 1040 -> 1100; f lies inside e
    assert gaps == [(1000, "c", "d")]  # 60 µs is under the 200 µs floor


def test_gpu_idle_names_the_kernel_that_ended_last_before_a_gap():
    span, idle, gaps = bench.gpu_idle([(0, 500, "long"), (10, 20, "short"), (900, 950, "next")])
    assert (span, idle) == (950, 400)
    assert gaps == [(400, "long", "next")]


@pytest.mark.parametrize("order", [1, -1])
def test_gpu_idle_does_not_depend_on_the_order_events_arrive_in(order):
    kernels = [(0, 10, "a"), (300, 310, "b"), (700, 710, "c")]
    assert bench.gpu_idle(kernels[::order]) == bench.gpu_idle(kernels)
