"""Defaults that several layers share (the drafter's config, the run schema, the planner, the CLI), one
named constant each. Plain Python: the planner and the CLI import it without torch."""

# The drafter's shape when a run does not say: z-lab's released drafters (5 layers, 16-token blocks).
DEFAULT_NUM_LAYERS = 5
DEFAULT_BLOCK_SIZE = 16
# The fewest target layers a drafter reads when a run does not say: z-lab's released drafters tap 5; one tap per drafter
# layer below that lost at scale (bench/results/acceptance-ablate-16384-2026-12-05: a 2-layer drafter, tau - 1 0.903
# with 2 taps, 0.975 with 3, 1.008 with 5; the draft round's cost barely moves).
DEFAULT_MIN_TAPPED_LAYERS = 5
