"""`experts_per_token: auto` (routing/top_k.py) on planted MoEs whose right k is known.

Halves: expert A is the dense model with its FFN's second half of channels cut and the first
half doubled (down_proj columns), expert B the other way round. With zero routers each token
weighs both 0.5 (Mixtral renormalises its top-k), so k = 2 computes 0.5·2·f₁ + 0.5·2·f₂ = f:
the dense model exactly, while k = 1 computes 2·f₁ only. On text sampled from the dense model,
the dense model has the least expected loss of any model (Gibbs' inequality): k = 2 must win.
Copies: experts identical to the dense model give the same loss at every k: k = 1, the cheaper.
"""

import json
import shutil

import pytest
import torch
from conftest import write_recipe
from safetensors.torch import load_file, save_file

from moemerge.api import build
from moemerge.io.writer import overwrite_tensors
from moemerge.loading import load_pretrained
from moemerge.routing.calibrate import token_nll
from moemerge.routing.top_k import choose_top_k, loaded_with_k, smallest_sufficient

LAYERS = 2


def test_the_smallest_k_within_a_tenth_of_a_percent_of_the_best_is_chosen():
    assert smallest_sufficient({1: 2.0, 2: 1.99, 3: 1.5}) == 3
    assert smallest_sufficient({1: 2.0, 2: 1.9995, 3: 2.1}) == 1  # 0.025 % better: not worth it
    assert smallest_sufficient({1: 2.0, 2: 1.99, 3: 1.9895}) == 2


def amplified(src, dst):
    """A tiny random model with peaked predictions that its FFNs move (at random init the
    logits are near zero: predictions near uniform whatever the FFN computes)."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if ".mlp." in name or name in ("lm_head.weight", "model.embed_tokens.weight"):
                tensors[name] = t * (8.0 if "down_proj" in name or "lm_head" in name else 3.0)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def halved(dense, dst, keep: int):
    """The dense model with FFN channels of half `keep` (0: first, 1: second) doubled in
    down_proj and the other half zeroed."""
    shutil.copytree(dense, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if name.endswith("mlp.down_proj.weight"):
                half = t.shape[1] // 2
                scaled = torch.zeros_like(t)
                cols = slice(0, half) if keep == 0 else slice(half, None)
                scaled[:, cols] = 2 * t[:, cols]
                tensors[name] = scaled
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def sampled_windows(model_dir, windows: int = 48, length: int = 33) -> torch.Tensor:
    """Windows [W, length] sampled from the dense model itself (its own distribution)."""
    model = load_pretrained("AutoModelForCausalLM", model_dir).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (windows, 1), generator=gen)
    with torch.no_grad():
        for _ in range(length - 1):
            probs = torch.softmax(model(input_ids=ids).logits[:, -1].double(), -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return ids


def moe_of(root, base, experts: dict, layout: str):
    lines = ["kind: moe", f"base_model: {base}", f"layout: {layout}", "experts_per_token: 2",
             "router: {init: random}", "experts:",
             *(f"  - {{model: {path}, name: {name}}}" for name, path in experts.items())]
    out = root / f"moe-{layout}-{'-'.join(experts)}"
    build(write_recipe(root / f"{out.name}.yaml", "\n".join(lines) + "\n"), out, progress=False,
          force=True)
    config = json.loads((out / "config.json").read_text())
    hidden = config["hidden_size"]
    router = ("model.layers.{}.block_sparse_moe.gate.weight" if layout == "mixtral"
              else "model.layers.{}.mlp.gate.weight")
    overwrite_tensors(out, {router.format(i): torch.zeros(2, hidden) for i in range(LAYERS)})
    return out


@pytest.fixture(scope="module")
def planted(model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("top_k")
    dense = amplified(model_factory("llama", layers=LAYERS), root / "dense")
    halves = {name: halved(dense, root / name, keep)
              for keep, name in enumerate(["first", "second"])}
    return root, dense, halves, sampled_windows(dense)


def test_halves_need_both_experts_and_k2_is_the_dense_model(planted):
    root, dense, halves, ids = planted
    moe = moe_of(root, dense, halves, "mixtral")
    choice = choose_top_k(loaded_with_k(moe), ids, 2)
    reference = float(token_nll(load_pretrained("AutoModelForCausalLM", dense).eval(), ids)
                      .double().mean())
    assert choice.losses[2] == pytest.approx(reference, abs=1e-5)  # exactly the dense model
    assert choice.losses[1] > choice.losses[2] + 1e-3  # and the comparison can fail
    assert choice.chosen == 2


def test_copies_of_the_dense_model_choose_one_expert(planted):
    root, dense, _, ids = planted
    copies = {"a": shutil.copytree(dense, root / "copy-a"),
              "b": shutil.copytree(dense, root / "copy-b")}
    choice = choose_top_k(loaded_with_k(moe_of(root, dense, copies, "mixtral")), ids, 2)
    assert choice.losses[1] == pytest.approx(choice.losses[2], abs=1e-6)
    assert choice.chosen == 1


@pytest.mark.parametrize("layout", ["mixtral", "qwen2_moe"])
def test_each_k_scores_the_model_whose_config_says_k(planted, layout, tmp_path):
    """The k-th loss is the model a user loads from a config.json with num_experts_per_tok k
    (transformers' own reading of the key), for a renormalising and a non-renormalising
    layout."""
    root, dense, halves, ids = planted
    moe = moe_of(root, dense, halves, layout)
    choice = choose_top_k(loaded_with_k(moe), ids[:8], 2)
    for k in (1, 2):
        copy = shutil.copytree(moe, tmp_path / f"k{k}")
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": k}))
        model = load_pretrained("AutoModelForCausalLM", copy).eval()
        assert choice.losses[k] == pytest.approx(float(token_nll(model, ids[:8]).double().mean()),
                                                 abs=1e-6)
    assert abs(choice.losses[1] - choice.losses[2]) > 1e-3
