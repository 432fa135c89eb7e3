"""moemerge: turn dense expert LLM checkpoints into Mixture-of-Experts models."""

__version__ = "0.1.0"
