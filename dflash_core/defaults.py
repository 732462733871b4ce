"""Defaults that several layers share (the drafter's config, the run schema, the planner, the CLI), one
named constant each. Plain Python: the planner and the CLI import it without torch."""

# The drafter's shape when a run does not say: z-lab's released drafters (5 layers, 16-token blocks).
DEFAULT_NUM_LAYERS = 5
DEFAULT_BLOCK_SIZE = 16
