"""Optimizing a Swin: recipes (data), passes (code), the workload, the correctness gate and timing."""
