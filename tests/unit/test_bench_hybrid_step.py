"""The hybrid bench's profile helpers (the bench itself needs a GPU for its figures)."""

from __future__ import annotations

import pytest

from bench.training import hybrid
from bench.training import hybrid_profile as profile


def test_gpu_idle_counts_only_time_no_kernel_ran():
    kernels = [(0, 10, "a"), (5, 20, "b"), (20, 30, "c"), (1030, 1040, "d"), (1100, 1200, "e"), (1150, 1160, "f")]
    span, idle, gaps = profile.gpu_idle(kernels)
    assert span == 1200
    assert idle == 1000 + 60  # 30 -> 1030 and 1040 -> 1100; f lies inside e
    assert gaps == [(1000, "c", "d")]  # 60 µs is under the 200 µs floor


def test_gpu_idle_names_the_kernel_that_ended_last_before_a_gap():
    span, idle, gaps = profile.gpu_idle([(0, 500, "long"), (10, 20, "short"), (900, 950, "next")])
    assert (span, idle) == (950, 400)
    assert gaps == [(400, "long", "next")]


@pytest.mark.parametrize("order", [1, -1])
def test_gpu_idle_does_not_depend_on_the_order_events_arrive_in(order):
    kernels = [(0, 10, "a"), (300, 310, "b"), (700, 710, "c")]
    assert profile.gpu_idle(kernels[::order]) == profile.gpu_idle(kernels)


class _Event:
    def __init__(self, name, parent=None, stack=()):
        self.name, self.cpu_parent, self.stack = name, parent, list(stack)


def test_copies_are_attributed_to_the_nearest_recorded_frames_of_our_code():
    frames = ["/x/site-packages/torch/nn/modules/module.py(1750): _call_impl",
              "/x/site-packages/fla/ops/utils.py(40): wrapper", "/x/site-packages/transformers/models/m.py(9): forward"]
    clone = _Event("aten::clone", _Event("aten::contiguous", _Event("fla op", stack=frames)))
    assert profile._caller(_Event("aten::copy_", clone)) == (
        "aten::clone <- aten::contiguous <- fla/ops/utils.py(40): wrapper <- transformers/models/m.py(9): forward")


def test_without_frames_one_call_site_in_every_layer_is_one_source():
    sources = set()
    for layer in range(6):
        step = _Event("ProfilerStep#3")
        module = _Event(f"nn.Module: Layer_{layer}", _Event("torch/nn/modules/module.py(1750): _call_impl", step))
        sources.add(profile._caller(_Event("aten::cat", _Event("<built-in method cat of type object at 0x7f00>", module))))
    assert sources == {"nn.Module: Layer <- ProfilerStep#3"}


def test_the_window_needs_a_warmup_step_and_a_timed_one():
    for bad in (["--warmup", "0"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            hybrid.main(["--tiny", *bad])
