"""Tiny PEFT LoRA adapters made with peft itself, and the build and forward helpers of the tests
that compare moemerge's use of them against peft (tests/integration/test_lora_*.py)."""

from __future__ import annotations

import torch
import yaml
from transformers import AutoModelForCausalLM

from moemerge.api import build_file
from moemerge.build_options import BuildOptions

IDS = torch.randint(0, 200, (2, 10), generator=torch.Generator().manual_seed(0))
LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load(path, **kwargs) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(input_ids=IDS).logits


def make_adapter(base, out, *, seed=0, perturb_saved=False, **config):
    """A peft LoRA adapter on `base`: A and B random (init_lora_weights=False, seeded); with
    `perturb_saved`, the modules peft saves whole (modules_to_save, biases) changed too."""
    import peft

    torch.manual_seed(seed)
    model = peft.get_peft_model(load(base), peft.LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if perturb_saved and ("modules_to_save" in name or name.endswith("bias")):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(out)
    return out


def build(tmp_path, recipe: dict, name="out", **options):
    """Build `recipe` (written next to nothing: absolute paths); (output dir, warnings)."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    notes: list[str] = []
    result = build_file(path, tmp_path / name if not options.get("dry_run") else None,
                        BuildOptions(**options), warn=notes.append)
    return result, notes
