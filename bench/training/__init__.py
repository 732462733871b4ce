"""Training benches: `step` (the GPU step alone), `loop` (the real Trainer end to end, with --profile), `hybrid`
(a Gated DeltaNet target, packed and unpacked), `multi_gpu` (DDP and the pair layout over two GPUs, kill -9 and
resume). `profile` and `hybrid_profile` read torch.profiler's traces for them; `multi_gpu_processes` and
`multi_gpu_report` start the training processes and read their figures."""
