"""--gradient-checkpointing on every kind: the decoder layers really run again in the backward
pass, and the gradients and the trained model are the same as without it."""

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.modeling import register
from moemerge.toy import TINY, cached_toy_experts
from moemerge.train.api import finetune
from moemerge.train.config import make_config
from moemerge.train.memory import enable_gradient_checkpointing

KINDS = {
    "token_routed": "assembly: token_routed\nexperts_per_token: 2",
    "seq_routed": "assembly: seq_routed\nrouter: {kind: learned}",
    "bridged": "assembly: bridged\nrouter: {kind: learned}\nprojectors: {hidden_size: 8}",
    "merged_experts": "assembly: merged_experts\nsegment_length: 4\ncurvature: {rank: 2}\n"
                      "mask: {kind: dare}",
}
IDS = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))


def loss_and_grads(model):
    torch.manual_seed(0)  # DARE-CA draws its expert mask in training
    model.zero_grad()
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def built_model(kind: str, model_factory, tmp_path):
    """A float32 MoE of `kind` from two perturbed copies of a tiny Llama, in training mode."""
    register()
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.1, seed=i) for i in range(2)]
    recipe = (f"kind: moe\n{'' if kind == 'bridged' else f'base_model: {base}'}\n"
              f"experts: [{experts[0]}, {experts[1]}]\n{KINDS[kind]}\n")
    build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "moe", progress=False)
    return AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).train()


@pytest.mark.parametrize("kind", KINDS)
def test_layers_recompute_and_gradients_match(kind, model_factory, tmp_path):
    model = built_model(kind, model_factory, tmp_path)
    plain = loss_and_grads(model)

    layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
    calls = []  # a module inside the layer: its hooks run again when the layer is recomputed
    layer.input_layernorm.register_forward_hook(lambda *_: calls.append(1))
    enable_gradient_checkpointing(model)
    checkpointed = loss_and_grads(model)
    assert len(calls) == 2  # the forward, and again in the backward pass
    torch.testing.assert_close(checkpointed[0], plain[0], rtol=0, atol=1e-6)
    assert checkpointed[1].keys() == plain[1].keys() and plain[1]
    for name, grad in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_finetune_with_checkpointing_trains_the_same_model(tmp_path):
    """Curvature and routers of a merged-experts model, 3 steps, with and without."""
    ts = cached_toy_experts(TINY, progress=False)
    lines = ["kind: moe", "assembly: merged_experts", f"base_model: {ts.base}",
             f"experts: [{', '.join(str(p) for p in ts.experts.values())}]",
             "segment_length: 16", "curvature: {rank: 1}"]
    build(write_recipe(tmp_path / "r.yaml", "\n".join(lines) + "\n"), tmp_path / "moe",
          progress=False)
    trained = []
    for on in (False, True):
        out = tmp_path / f"out-{on}"
        finetune(make_config(None, {
            "model": str(tmp_path / "moe"), "output": str(out), "train": ["curvature",
                                                                          "routers"],
            "data": [f"{d}={p}" for d, p in ts.train_text.items()], "seq_len": 32,
            "batch_size": 4, "steps": 3, "lr": 1e-2, "device": "cpu",
            "gradient_checkpointing": on}))
        trained.append(load_file(out / "model.safetensors"))
    for name, tensor in trained[0].items():
        torch.testing.assert_close(trained[1][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
