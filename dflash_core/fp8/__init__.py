"""FP8 GEMMs in training, each opt-in: the frozen target's decoder-layer linears (`target`: row-wise scales
through `torch._scaled_mm`, `TrainConfig.target_fp8`) and the drafter's own linears (`drafter`: torchao's float8
training, `TrainConfig.drafter_fp8`). The drafter's FP8 LM head lives with the drafter (dflash_core.model.lm_head_fp8)."""
