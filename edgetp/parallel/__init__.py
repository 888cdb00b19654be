"""Tensor parallelism: the speed-weighted planner, weight slicing, collectives."""
