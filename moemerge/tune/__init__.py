"""Choose merge λ and density per tensor role on held-out text (`moemerge build --tune-on`)."""

from moemerge.tune.output import TUNING_FILE, tuned_recipe_text, tuning_json, tuning_table
from moemerge.tune.run import tune_recipe
from moemerge.tune.search import (
    Candidate,
    Progress,
    TuneOptions,
    TuneResult,
    check_length,
    check_options,
    read_held_out,
    search,
    tunable_jobs,
)

__all__ = [
    "TUNING_FILE", "Candidate", "Progress", "TuneOptions", "TuneResult", "check_length",
    "check_options", "read_held_out", "search", "tunable_jobs", "tune_recipe",
    "tuned_recipe_text", "tuning_json", "tuning_table",
]
