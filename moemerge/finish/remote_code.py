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
                  "modeling_lora_moemerge.py",
                  "configuration_deepseek.py", "modeling_deepseek.py")


def needs_remote_code(config: dict) -> bool:
    """Whether transformers loads a model of this config.json only with
    `trust_remote_code=True`: its `auto_map` names modeling code beside the weights (moemerge's
    own kinds, the DeepSeek-MoE layout); without one transformers has the class."""
    return bool(config.get("auto_map"))


def load_call(where: str) -> str:
    """How a model with modeling code beside its weights is loaded."""
    return f"AutoModelForCausalLM.from_pretrained({where}, trust_remote_code=True)"


def copy_modeling_code(directory: Path) -> None:
    package = resources.files("moemerge.modeling")
    for name in MODELING_FILES:
        with resources.as_file(package.joinpath(name)) as source:
            shutil.copyfile(source, directory / name)
