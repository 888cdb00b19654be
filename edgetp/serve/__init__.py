"""Serving: the worker that holds a shard, the root that serves requests."""
