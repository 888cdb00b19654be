"""Tensor and pipeline parallelism: the speed-weighted planner, plan kinds and their cost, weight slicing,
collectives, the root's runner."""

# what --experts may force (the cost model decides, or forced): here, without the planner's numpy,
# for the command line and the settings
EXPERT_MODES = ("auto", "columns", "place", "mixed")
