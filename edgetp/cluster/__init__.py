"""Cluster membership: discovery, election, device profiling."""
