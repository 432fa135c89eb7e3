"""What every reference needs: the source models, and the tensors of a built output."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def dense(path: Path) -> torch.nn.Module:
    """A source checkpoint as its own transformers class, float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def embedding(model) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach()


def head(model) -> torch.Tensor:
    """The output projection [V, d]; a tied model's is its embedding."""
    return model.get_output_embeddings().weight.detach()


def output_tensors(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a built model directory, float32."""
    found = {}
    for file in sorted(Path(out).glob("*.safetensors")):
        found |= {k: v.float() for k, v in load_file(file).items()}
    return found


def overwrite(out: Path, pick, scale: float, seed: int) -> None:
    """Replace the tensors of `out` whose name satisfies `pick` by N(0, scale²) values: weights
    a merge cannot set (routers, projector branches), as a fine-tune would leave them."""
    gen = torch.Generator().manual_seed(seed)
    for file in sorted(Path(out).glob("*.safetensors")):
        tensors = load_file(file)
        for name, t in tensors.items():
            if pick(name):
                tensors[name] = (scale * torch.randn(t.shape, generator=gen)).to(t.dtype)
        save_file(tensors, file, metadata={"format": "pt"})


def final_hidden(model, embeds: torch.Tensor) -> torch.Tensor:
    """The dense model's decoder stack and final norm on token embeddings [T, d] -> [T, d]."""
    return model.model(inputs_embeds=embeds[None]).last_hidden_state[0]
