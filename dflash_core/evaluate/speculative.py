"""Greedy speculative decoding with a DFlash drafter, block or DDTree mode, and the target-only
baseline in the same harness. Batch size one: each response is decoded on its own.

A round: the drafter drafts B-1 tokens in one pass from its context cache (target features of
every verified token) and the last accepted token; the target verifies them in one forward; the
longest prefix equal to the target's own greedy choices is accepted plus one bonus token (the
target's choice after it); both caches are cut back to the accepted length. The emitted tokens
are therefore exactly the target's greedy decoding, whatever the drafter proposes.

A round counts only the tokens decoding keeps, as z-lab's `dflash_generate` counts them (its
`produced`): never past `max_new_tokens`, and nothing after an EOS (the EOS itself counts). So
the last round of a response can count fewer tokens than the target verified.

Block rounds draft through `draft_tokens`: DFlash proposes the argmax of each slot, DFlash 2 the
candidate selector's greedy path from the last accepted token (what z-lab's `dflash_generate`
serves). DDTree builds its tree from per-slot distributions, which a selector path is not: tree
mode is DFlash-only.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from dflash_core.evaluate.target_runner import TargetRunner
from dflash_core.evaluate.tree import accepted_path, build_draft_tree
from dflash_core.model.dflash2 import DFlash2DraftModel, draft_tokens

MODES = ("block", "tree")


def supported_modes(drafter: torch.nn.Module) -> tuple[str, ...]:
    """The decoding modes a drafter can be evaluated in: DDTree is DFlash-only."""
    return ("block",) if isinstance(drafter, DFlash2DraftModel) else MODES


@dataclasses.dataclass
class Decoded:
    """tokens: the new tokens. accepted: per round, the tokens it added minus one (tau_round =
    accepted + 1): the drafted tokens the target accepted, except in a last round cut short by
    `max_new_tokens` or an EOS, which counts only the tokens kept. sum(accepted + 1) is
    len(tokens) - 1 (the first token comes from the prefill)."""

    tokens: list[int]
    accepted: list[int]
    wall_s: float
    num_target_forwards: int
    # Where a speculative response's time went, summed over its rounds (seconds of wall clock; each phase ends
    # in the host reading its result, so the GPU work it queued is inside it): drafting, verifying (the target's
    # forward and the acceptance check), and the rest (cache roll-back and the drafter's context update, whose GPU
    # work the next draft waits for). Zero for target-only decoding.
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def tau(self) -> float:
        return sum(a + 1 for a in self.accepted) / len(self.accepted) if self.accepted else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _finish(tokens: list[int], *, max_new_tokens: int, eos_token_id: int | None) -> tuple[list[int], bool]:
    """Cut at max_new_tokens and after the first EOS; True when decoding is over."""
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1][:max_new_tokens], True
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def kept_tokens(new: list[int], *, room: int, eos_token_id: int | None) -> int:
    """How many of a round's new tokens decoding keeps: at most `room` (what max_new_tokens leaves),
    and none after the first EOS among them."""
    kept = min(len(new), room)
    if eos_token_id is not None and eos_token_id in new[:kept]:
        kept = new.index(eos_token_id) + 1
    return kept


@torch.no_grad()
def greedy_decode(target: torch.nn.Module, prompt: list[int], *, max_new_tokens: int,
                  eos_token_id: int | None = None) -> Decoded:
    """Target-only greedy decoding with a KV cache: the reference output and the speed baseline."""
    runner = TargetRunner(target, layer_ids=[0])
    _sync(runner.device)
    start = time.perf_counter()
    token = int(runner.prefill(prompt, hidden=False).logits[-1].argmax())
    tokens = [token]
    forwards = 1
    while not _finish(tokens, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)[1]:
        token = int(runner.step(token).argmax())
        tokens.append(token)
        forwards += 1
    _sync(runner.device)
    tokens, _ = _finish(tokens, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
    return Decoded(tokens=tokens, accepted=[], wall_s=time.perf_counter() - start, num_target_forwards=forwards)


class SpeculativeDecoder:
    """Draft/verify rounds with a target and a DFlash drafter attached to it (same device and dtype)."""

    def __init__(self, *, target: torch.nn.Module, drafter: torch.nn.Module, mode: str = "block",
                 tree_budget: int | None = None, tree_branch: int = 8) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode not in supported_modes(drafter):
            raise ValueError(
                f"mode {mode!r} is DFlash-only: DDTree expands per-slot distributions, while a DFlash 2 drafter "
                "proposes the candidate selector's path (each slot's choice depends on the previous one); "
                "evaluate it with mode='block'"
            )
        self.target = target
        self.drafter = drafter.eval()
        self.block_size = drafter.config.block_size
        self.mode = mode
        self.tree_budget = tree_budget or 4 * (self.block_size - 1)
        if self.tree_budget < 1:
            raise ValueError(f"tree_budget must be >= 1, got {tree_budget}")
        self.tree_branch = tree_branch
        self.runner = TargetRunner(target, layer_ids=drafter.config.target_layer_ids)
        if mode == "tree" and self.runner.is_hybrid:
            raise ValueError("tree mode needs an attention-only target; hybrid (GDN) targets support mode='block' only")
        self._feature_dtype = drafter.fc.weight.dtype

    def _extend(self, cache, tapped: torch.Tensor, *, start: int) -> None:
        positions = torch.arange(start, start + tapped.shape[0], device=tapped.device)[None]
        self.drafter.extend_context(cache, target_hidden=tapped[None].to(self._feature_dtype), position_ids=positions)

    def _draft_inputs(self, cache, last_token: int) -> dict[str, torch.Tensor]:
        device = self.runner.device
        return {"last_token_ids": torch.tensor([last_token], device=device),
                "position_ids": torch.tensor([cache.length], device=device)}

    def _draft_logits(self, cache, last_token: int) -> torch.Tensor:
        return self.drafter.draft_block(cache, **self._draft_inputs(cache, last_token))[0]

    def _block_round(self, cache, last_token: int) -> list[int]:
        """One round; returns the new tokens: the accepted drafts and the bonus token."""
        start = self.runner.length
        began = time.perf_counter()
        drafts = draft_tokens(self.drafter, cache, **self._draft_inputs(cache, last_token))[0].tolist()
        drafted = time.perf_counter()
        fed = [last_token, *drafts]
        step = self.runner.verify_block(fed)
        choices = step.logits.argmax(-1).tolist()  # choices[i]: target's token after fed[i]
        self._times[0] += drafted - began
        self._times[1] += time.perf_counter() - drafted
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
            accepted += 1
        self.runner.keep_block_prefix(num_fed=len(fed), num_kept=accepted + 1)
        self._extend(cache, step.tapped[: accepted + 1], start=start)
        return drafts[:accepted] + [choices[accepted]]

    def _tree_round(self, cache, last_token: int) -> list[int]:
        start = self.runner.length
        began = time.perf_counter()
        tree = build_draft_tree(self._draft_logits(cache, last_token), root_token=last_token,
                                budget=self.tree_budget, max_branch=self.tree_branch)
        drafted = time.perf_counter()
        step = self.runner.verify_tree(tree.tokens, ancestor_mask=tree.ancestor_mask(), depths=tree.depths)
        choices = step.logits.argmax(-1).tolist()
        self._times[0] += drafted - began
        self._times[1] += time.perf_counter() - drafted
        path = accepted_path(tree, choices)
        kept = [0, *path]
        self.runner.keep_tree_nodes(num_fed=len(tree.tokens), keep_nodes=kept)
        self._extend(cache, step.tapped[torch.tensor(kept, device=step.tapped.device)], start=start)
        return [tree.tokens[n] for n in path] + [choices[kept[-1]]]

    @torch.no_grad()
    def generate(self, prompt: list[int], *, max_new_tokens: int, eos_token_id: int | None = None) -> Decoded:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        device = self.runner.device
        _sync(device)
        self._times = [0.0, 0.0]  # draft, verify
        begin = time.perf_counter()
        step = self.runner.prefill(prompt)
        cache = self.drafter.new_cache()
        self._extend(cache, step.tapped, start=0)
        tokens = [int(step.logits[-1].argmax())]
        accepted_per_round: list[int] = []
        forwards = 1
        round_fn = self._block_round if self.mode == "block" else self._tree_round
        while not _finish(tokens, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)[1]:
            new = round_fn(cache, tokens[-1])
            kept = kept_tokens(new, room=max_new_tokens - len(tokens), eos_token_id=eos_token_id)
            tokens.extend(new[:kept])
            accepted_per_round.append(kept - 1)
            forwards += 1
        _sync(device)
        return Decoded(tokens=tokens, accepted=accepted_per_round, wall_s=time.perf_counter() - begin,
                       num_target_forwards=forwards, draft_s=self._times[0], verify_s=self._times[1])
