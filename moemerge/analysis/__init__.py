"""`moemerge inspect`: task-vector statistics between experts, and their renderings."""

from moemerge.analysis.task_vectors import (
    GroupResult,
    GroupStats,
    TaskVectorReport,
    recipe_models,
    task_vector_report,
)
from moemerge.analysis.verdict import verdict

__all__ = [
    "GroupResult", "GroupStats", "TaskVectorReport", "recipe_models", "task_vector_report",
    "verdict",
]
