"""Defaults that several layers share (the drafter's config, the run schema, the planner, the CLI), one
named constant or rule each. Plain Python: the planner and the CLI import it without torch."""

# The drafter's shape when a run does not say: z-lab's released drafters (5 layers, 16-token blocks).
DEFAULT_NUM_LAYERS = 5
DEFAULT_BLOCK_SIZE = 16
# The fewest target layers a drafter reads when a run does not say: z-lab's released drafters tap 5, and one
# tap per drafter layer below that lost at scale (bench/results/2026-12-05_h100_acceptance-ablation: a 2-layer
# drafter's tau - 1 was 0.903 with 2 taps, 0.975 with 3, 1.008 with 5; a draft round's cost barely moves).
DEFAULT_MIN_TAPPED_LAYERS = 5


def default_tapped_layer_count(*, num_layers: int, num_target_layers: int | None = None) -> int:
    """The tapped layers a drafter of `num_layers` reads when a run does not say: one per drafter layer (the z-lab
    reference), at least DEFAULT_MIN_TAPPED_LAYERS, that floor cut to the distinct ids (1 .. N-3) a shallow target
    has; without the target's depth, the count on a deep one."""
    floor = DEFAULT_MIN_TAPPED_LAYERS
    if num_target_layers is not None:
        floor = min(floor, max(1, num_target_layers - 3))
    return max(num_layers, floor)


# Anchors per packed row when a run does not say: a fixed density per token of the row, so the drafter's query
# tokens (anchors x block_size), its memory and its step time follow `token_budget`. 512 anchors per 2,048 tokens
# (2,048 at the default 8,192-token budget): the density of the default recipe in bench/acceptance/, where it beat
# 128 per 2,048 (speculators' 512 per 8,192) for every variant.
ANCHORS_PER_1024_TOKENS = 256


def default_num_anchors(token_budget: int) -> int:
    """Anchors per packed row of `token_budget` tokens at ANCHORS_PER_1024_TOKENS (at least one)."""
    return max(1, token_budget * ANCHORS_PER_1024_TOKENS // 1024)
