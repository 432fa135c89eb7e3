"""Tiny random MoE checkpoints of every family moemerge reads, saved by transformers' own
classes in both on-disk forms: `classic` is what `save_pretrained` writes (per-expert tensors;
GraniteMoE's input_linear stacks), `fused` is the model's own state dict (transformers 5's
gate_up_proj / down_proj stacks), the form mergekit 0.1.5 writes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moemerge.architectures.forms import CLASSIC, FUSED

COMMON = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)
DEEPSEEK = dict(n_routed_experts=3, moe_intermediate_size=16, n_shared_experts=1,
                first_k_dense_replace=1, kv_lora_rank=8, qk_rope_head_dim=4,
                qk_nope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
                num_key_value_heads=4)  # (latent attention: as many kv heads as heads)
# family -> (transformers config class, its own settings): 3 experts, top-2
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=3)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=3, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=3, moe_intermediate_size=16, head_dim=8)),
    "olmoe": ("OlmoeConfig", dict(num_experts=3)),
    "granitemoe": ("GraniteMoeConfig", dict(num_local_experts=3)),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(num_local_experts=3,
                                                        shared_intermediate_size=24)),
    "flex_olmo": ("FlexOlmoConfig", dict(num_experts=3)),
    "deepseek_v2": ("DeepseekV2Config", dict(DEEPSEEK, q_lora_rank=None)),
    "deepseek_v3": ("DeepseekV3Config", dict(DEEPSEEK, q_lora_rank=8)),
}


def tiny_moe_model(family: str, seed: int = 0):
    """The transformers model of `family`, random weights of scale ~0.1 (every tensor,
    norms and router biases included, so that no two experts and no two inputs agree)."""
    import pytest
    import transformers

    config_class, own = FAMILIES[family]
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    config = getattr(transformers, config_class)(**{**COMMON, **own}, num_experts_per_tok=2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(torch.randn_like(tensor) * 0.1 + (tensor.dim() == 1))
    return model


def save_moe(model, path: Path, form: str) -> Path:
    """`model` saved in `form`; a tokenizer-free directory (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    path = Path(path)
    if form == CLASSIC:
        model.save_pretrained(path)
    else:
        assert form == FUSED
        import pytest
        import transformers

        if int(transformers.__version__.split(".")[0]) < 5:  # (its state dict is classic)
            pytest.skip(f"transformers {transformers.__version__} holds no fused stacks")
        path.mkdir(parents=True)
        model.config.architectures = [type(model).__name__]  # (as save_pretrained sets it)
        model.config.save_pretrained(path)
        state = {n: t.contiguous() for n, t in model.state_dict().items()}
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def tensor_names(path: Path) -> list[str]:
    with open(path / "model.safetensors", "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return [n for n in json.loads(f.read(length)) if n != "__metadata__"]


IDS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(0))


def logits(path: Path, ids: torch.Tensor = IDS) -> torch.Tensor:
    """The logits transformers computes from the checkpoint at `path` (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def hub_moes(tmp_path_factory, tokenizer):
    """make(family, form) -> a directory: one random model per family (seed 0) saved in
    `form`, with a tokenizer; `make.model(family)` is the model itself (a module fixture of
    the test files that read hub-shaped MoEs)."""
    made, models = {}, {}

    def make(family: str, form: str) -> Path:
        if family not in models:
            models[family] = tiny_moe_model(family)
        if (family, form) not in made:
            path = save_moe(models[family], tmp_path_factory.mktemp(family) / form, form)
            tokenizer.save_pretrained(path)
            made[family, form] = path
        return made[family, form]

    make.model = lambda family: models[family]
    return make
