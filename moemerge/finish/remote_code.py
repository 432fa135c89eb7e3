"""The modeling code of moemerge's own MoE kinds (and of the DeepSeek-MoE layout, which
transformers has no class for), copied next to the weights.

config.json's `auto_map` names these files, so `AutoModelForCausalLM.from_pretrained(out,
trust_remote_code=True)` loads the model with no moemerge installed. They are copied from the
installed package (moemerge/modeling/), the same code moemerge's tests run.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

MODELING_FILES = ("configuration_moemerge.py", "pretrained_moemerge.py", "routing_moemerge.py",
                  "modeling_moemerge.py", "curvature_moemerge.py", "modeling_merged_moemerge.py",
                  "configuration_deepseek.py", "modeling_deepseek.py")


def copy_modeling_code(directory: Path) -> None:
    package = resources.files("moemerge.modeling")
    for name in MODELING_FILES:
        with resources.as_file(package.joinpath(name)) as source:
            shutil.copyfile(source, directory / name)
