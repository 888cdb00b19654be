"""Tensor and pipeline parallelism: the speed-weighted planner, plan kinds and their cost, weight slicing,
collectives, the root's runner."""
