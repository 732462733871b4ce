"""Decoding benches: `speed` (speculative decoding against target-only in our evaluator's harnesses),
`served_as_trained` (our evaluator against z-lab's runtime on the native export), `draft_cost` (a draft round's
cost, DFlash against DFlash 2)."""
