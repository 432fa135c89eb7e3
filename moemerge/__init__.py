"""moemerge: turn dense expert LLM checkpoints into Mixture-of-Experts models."""

import os

# Tensors of 2 MiB and more on transparent huge pages (torch reads this once, at its first
# allocation, so only when moemerge is imported before torch; a user's own setting wins).
# Reading a checkpoint into fresh tensors faults every 4 KiB page in: on a 2.5 GB model
# 598k faults and 1.5-2.0 s, against 39k and 0.5 s on huge pages (benchmarks/results/scale.md).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
