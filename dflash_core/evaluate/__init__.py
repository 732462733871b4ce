"""Acceptance-faithful evaluation of a DFlash drafter against its target: real draft/verify rounds
(block or DDTree; a DFlash 2 drafter: block rounds on its selector path), compared token for token
with the target's own greedy decoding.

    report = evaluate_prompts(target=t, drafter=d, prompts=[[...], ...], modes=("block", "tree"),
                              max_new_tokens=128)

The names below load on first use, so that a torch-free submodule (`generalization`) imports no torch.
"""

from dflash_core.lazy_names import lazy_getattr

_HOMES = {
    "MODES": "speculative", "Decoded": "speculative", "SpeculativeDecoder": "speculative",
    "greedy_decode": "speculative", "supported_modes": "speculative",
    "DraftTree": "tree", "accepted_path": "tree", "build_draft_tree": "tree",
    "markdown_table": "report", "plot_acceptance": "report", "summarize": "report",
    "HARNESSES": "run", "evaluate_prompts": "run", "pick_harness": "run",
    "GraphedDecoder": "graphed",
    "Divergence": "divergence", "first_divergence": "divergence", "match_label": "match",
}

__all__ = sorted(_HOMES)

__getattr__ = lazy_getattr(__name__, _HOMES)
