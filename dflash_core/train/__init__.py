"""Online training: data packing, run schema, checkpoints, metrics and the training loop."""
