"""Batch-one decoding in fixed shapes, replayed as CUDA graphs: target-only greedy decoding and
block-mode speculative decoding, the same algorithm as `speculative.py`.

Eager transformers at batch one is launch-bound: a small target spends milliseconds per token on
Python and kernel launches for microseconds of math, and that overhead, not the drafter, decides
the measured speedup. Here every per-token step has one shape. The target decodes on transformers'
StaticCache, whose length is a device tensor that a rejected draft rolls back in place; the drafter
on a StaticContextCache. A speculative round is two device programs: draft (the drafter's block
pass and its greedy choice) and verify (the target's forward over [last token, drafts], the
accepted length, the roll-back of the target's cache, the drafter's context update, the next last
token). Each is captured once as a CUDA graph and replayed; the host reads one small tensor per
target-only token or per round (the accepted length and the target's choices), one step behind:
every input of the next step is already on the device, so the host launches step k+1 before it
reads step k, and the GPU never waits for Python (a step launched past the end is waited for and
counted). Prefill stays eager: its length varies.

On CPU the same steps run without graphs; the tests compare their tokens with the eager harness.
Attention-only targets, block mode only: tree rounds change shape with the tree, and a hybrid
target's recurrent state cannot be rolled back in place (both stay on the eager harness).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import StaticCache

from dflash_core.evaluate.speculative import Decoded, _finish, _sync, kept_tokens
from dflash_core.evaluate.target_runner import TargetRunner
from dflash_core.model.dflash2 import draft_tokens


class _Replayed:
    """`fn` (no arguments; reads and writes fixed tensors) captured as a CUDA graph by `capture`, then
    replayed on each call; called as it is where there is no CUDA."""

    def __init__(self, fn: Callable[[], Any], *, device: torch.device, pool) -> None:
        self.fn, self.device, self.pool = fn, device, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None

    def capture(self, *, warmup: int = 2) -> None:
        """Run `fn` a few times on a side stream (allocator and library setup happen there, not in the
        graph), then record it. Both change the decoding state: the caller resets it afterwards."""
        if self.device.type != "cuda":
            return
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                self.fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.outputs = self.fn()

    def __call__(self) -> Any:
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.outputs


class _Clock:
    """Times the phases of a round: CUDA events on a GPU (read after the round's one sync), the host
    clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1000 if self.cuda else end - start


class GraphedDecoder:
    """Target-only greedy (`greedy`) and block-mode speculative (`generate`) decoding of one prompt at a
    time with fixed-shape caches of `capacity` positions (at least the longest prompt + max_new_tokens
    + 2 blocks). `drafter` None: target-only decoding only."""

    def __init__(self, *, target: torch.nn.Module, drafter: torch.nn.Module | None, capacity: int) -> None:
        layer_ids = drafter.config.target_layer_ids if drafter is not None else [0]
        runner = TargetRunner(target, layer_ids=layer_ids)  # the same checks as the eager harness
        if runner.is_hybrid:
            raise ValueError("CUDA-graph decoding needs an attention-only target: a hybrid (GDN) target's recurrent "
                             "state cannot be rolled back in place; use the eager harness")
        self.target, self.drafter, self.layer_ids = target, drafter, runner.layer_ids
        self.device = runner.device
        self.block_size = drafter.config.block_size if drafter is not None else 1
        self.capacity = capacity
        self.cache = StaticCache(config=target.config, max_cache_len=capacity)
        params = inspect.signature(target.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        device = self.device
        self.last_token = torch.zeros(1, dtype=torch.long, device=device)  # the newest token, not yet in a cache
        self.position = torch.zeros((), dtype=torch.long, device=device)  # target-only: tokens in the cache
        self.context = drafter.new_static_cache(capacity=capacity) if drafter is not None else None
        self._feature_dtype = drafter.fc.weight.dtype if drafter is not None else None
        self.drafts = torch.zeros(max(self.block_size - 1, 1), dtype=torch.long, device=device)
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self._step = _Replayed(self._step_fn, device=device, pool=pool)
        self._draft = _Replayed(self._draft_fn, device=device, pool=pool)
        self._verify = _Replayed(self._verify_fn, device=device, pool=pool)
        self._clock = _Clock(device)
        self._readback = _Readback(size=self.block_size + 1, device=device)  # [accepted, choices...]
        self._capture()

    # -- device programs ----------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *, hidden: bool, all_logits: bool):
        return self.target(input_ids=input_ids, position_ids=position_ids, **{self._cache_kwarg: self.cache},
                           use_cache=True, output_hidden_states=hidden, logits_to_keep=0 if all_logits else 1)

    def _tapped(self, out) -> torch.Tensor:
        return torch.cat([out.hidden_states[k + 1][0] for k in self.layer_ids], dim=-1)

    def _step_fn(self) -> torch.Tensor:
        out = self._forward(self.last_token[None], self.position.view(1, 1), hidden=False, all_logits=False)
        token = out.logits[0, -1].argmax(-1, keepdim=True)
        self.last_token.copy_(token)
        self.position.add_(1)
        return token

    def _draft_fn(self) -> torch.Tensor:
        drafts = draft_tokens(self.drafter, self.context, last_token_ids=self.last_token,
                              position_ids=self.context.length.view(1))[0]
        self.drafts.copy_(drafts)
        return drafts

    def _verify_fn(self) -> torch.Tensor:
        """[accepted, choices...]: how many drafts the target accepted and its own choice after each fed
        token (the new tokens are choices[:accepted + 1]); rolls both caches to the verified tokens."""
        block = self.block_size
        fed = torch.cat((self.last_token, self.drafts))
        out = self._forward(fed[None], self.context.positions(block), hidden=True, all_logits=True)
        choices = out.logits[0].argmax(-1)
        accepted = torch.cumprod((self.drafts == choices[:-1]).long(), dim=0).sum()
        rejected = (block - 1) - accepted
        for layer in self.cache.layers:
            layer.cumulative_length.sub_(rejected)
        self.drafter.extend_context(self.context, target_hidden=self._tapped(out)[None].to(self._feature_dtype),
                                    position_ids=self.context.positions(block), keep=accepted + 1)
        self.last_token.copy_(choices.gather(0, accepted.view(1)))
        return torch.cat((accepted.view(1), choices))

    # -- setup ---------------------------------------------------------------------------------
    def _reset(self) -> None:
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False):
                layer.cumulative_length.zero_()
        self.position.zero_()
        if self.context is not None:
            self.context.reset()

    def _prefill(self, prompt: list[int], *, hidden: bool) -> None:
        self._reset()
        ids = torch.tensor([prompt], device=self.device)
        positions = torch.arange(len(prompt), device=self.device)[None]
        out = self._forward(ids, positions, hidden=hidden, all_logits=False)
        self.last_token.copy_(out.logits[0, -1].argmax(-1, keepdim=True))
        self.position.fill_(len(prompt))
        if hidden:
            self.drafter.extend_context(self.context, target_hidden=self._tapped(out)[None].to(self._feature_dtype),
                                        position_ids=positions)

    @torch.no_grad()
    def _capture(self) -> None:
        """Record each program once on a throwaway prompt (the caches' buffers exist after a prefill)."""
        dummy = [0] * 8
        self._prefill(dummy, hidden=self.drafter is not None)
        self._step.capture()
        if self.drafter is not None:
            self._draft.capture()
            self._verify.capture()
        self._reset()

    def _check_room(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ValueError("prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = len(prompt) + max_new_tokens + 2 * self.block_size
        if need > self.capacity:
            raise ValueError(f"a {len(prompt)}-token prompt with {max_new_tokens} new tokens needs {need} cache "
                             f"positions; this decoder holds {self.capacity}")

    # -- decoding ------------------------------------------------------------------------------
    @torch.no_grad()
    def greedy(self, prompt: list[int], *, max_new_tokens: int, eos_token_id: int | None = None) -> Decoded:
        """Target-only greedy decoding: the reference output and the speed baseline."""
        self._check_room(prompt, max_new_tokens)
        _sync(self.device)
        start = time.perf_counter()
        self._prefill(prompt, hidden=False)
        tokens = [int(self.last_token)]
        forwards = 1
        pending = None  # the step in flight, read one step behind
        while True:
            done = _finish(tokens, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)[1]
            launched = None if done else self._readback.push(self._step())
            if pending is not None:
                tokens.append(self._readback.read(pending)[0])
                forwards += 1
            pending = launched
            if _finish(tokens, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)[1]:
                break
        _sync(self.device)  # a step launched past the end counts in the wall time, as it occupied the GPU
        tokens, _ = _finish(tokens, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
        return Decoded(tokens=tokens, accepted=[], wall_s=time.perf_counter() - start, num_target_forwards=forwards)

    @torch.no_grad()
    def generate(self, prompt: list[int], *, max_new_tokens: int, eos_token_id: int | None = None) -> Decoded:
        """Block-mode speculative decoding; the same tokens and round accounting as SpeculativeDecoder."""
        if self.drafter is None:
            raise ValueError("this decoder was built without a drafter: target-only decoding only")
        self._check_room(prompt, max_new_tokens)
        _sync(self.device)
        begin = time.perf_counter()
        self._prefill(prompt, hidden=True)
        tokens = [int(self.last_token)]
        accepted_per_round: list[int] = []
        draft_s = verify_s = 0.0
        forwards = 1
        pending = None  # (readback slot, phase marks) of the round in flight, read one round behind
        while True:
            launched = None
            if not _finish(tokens, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)[1]:
                marks = [self._clock.mark()]
                self._draft()
                marks.append(self._clock.mark())
                result = self._verify()
                marks.append(self._clock.mark())
                launched = (self._readback.push(result), marks)
            if pending is not None:
                slot, marks = pending
                accepted, *choices = self._readback.read(slot)
                draft_s += self._clock.seconds(marks[0], marks[1])
                verify_s += self._clock.seconds(marks[1], marks[2])
                new = choices[: accepted + 1]
                kept = kept_tokens(new, room=max_new_tokens - len(tokens), eos_token_id=eos_token_id)
                tokens.extend(new[:kept])
                accepted_per_round.append(kept - 1)
                forwards += 1
            pending = launched
            if _finish(tokens, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)[1]:
                break
        _sync(self.device)  # a round launched past the end counts in the wall time, as it occupied the GPU
        return Decoded(tokens=tokens, accepted=accepted_per_round, wall_s=time.perf_counter() - begin,
                       num_target_forwards=forwards, draft_s=draft_s, verify_s=verify_s)


class _Readback:
    """A replayed program's small output copied to the host one call behind: the device runs step k+1 (its
    inputs are already on the device) while the host reads step k, so the GPU never waits for Python.
    Two pinned buffers alternate; each copy is followed by an event the read waits for."""

    def __init__(self, *, size: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(size, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def push(self, output: torch.Tensor) -> int:
        slot, self.turn = self.turn, self.turn ^ 1
        self.buffers[slot][: output.numel()].copy_(output, non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        return slot

    def read(self, slot: int) -> list[int]:
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return self.buffers[slot].tolist()


def graphs_supported(target: torch.nn.Module, modes: tuple[str, ...]) -> str | None:
    """Why the CUDA-graph harness cannot decode these modes on this target, or None when it can."""
    if set(modes) - {"block"}:
        return "tree rounds change shape with the tree: the CUDA-graph harness decodes mode 'block' only"
    text = getattr(target.config, "text_config", None) or target.config
    if any(t not in ("full_attention", "sliding_attention") for t in (getattr(text, "layer_types", None) or [])):
        return "a hybrid (GDN) target's recurrent state cannot be rolled back in place"
    return None
