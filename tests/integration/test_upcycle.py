"""kind: upcycle: one dense model into an MoE that starts exactly at the dense model."""

import json

import pytest
import torch
import yaml
from conftest import build_noting, needs_class, perturbed_copy, write_recipe
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.errors import RecipeError

ATOL = 1e-5
LAYOUT = {"llama": "mixtral", "qwen3": "qwen3_moe", "qwen2": "qwen2_moe", "olmo2": "flex_olmo",
          "granite": "granitemoe"}  # GraniteMoE: fused experts (plan/fused.py)
UPCYCLED = ["llama", "qwen3", "qwen2", "granite",
            pytest.param("olmo2", marks=needs_class("FlexOlmoForCausalLM"))]
DOWN = {"mixtral": "model.layers.{layer}.block_sparse_moe.experts.{e}.w2.weight",
        "qwen3_moe": "model.layers.{layer}.mlp.experts.{e}.down_proj.weight"}
GATE = {"mixtral": "model.layers.{layer}.block_sparse_moe.experts.{e}.w1.weight",
        "qwen3_moe": "model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"}
UP = {"mixtral": "model.layers.{layer}.block_sparse_moe.experts.{e}.w3.weight",
      "qwen3_moe": "model.layers.{layer}.mlp.experts.{e}.up_proj.weight"}


@pytest.fixture(scope="module")
def dense(model_factory, tmp_path_factory):
    """family -> a tiny dense model whose FFN matters: N(0, 0.3²) added to its FFN weights, so
    a wrong expert scale or a split copy moves the logits far beyond ATOL."""
    root, made = tmp_path_factory.mktemp("dense"), {}

    def make(family: str):
        if family not in made:
            made[family] = perturbed_copy(model_factory(family), root / family, scale=0.3,
                                          seed=1, only="mlp")
        return made[family]

    return make


def upcycle(tmp_path, model, out="moe", **fields):
    fields = {"experts": 4, "experts_per_token": 2, **fields}
    text = f"kind: upcycle\nmodel: {model}\n" + "".join(f"{k}: {v}\n" for k, v in fields.items())
    recipe = write_recipe(tmp_path / f"{out}.yaml", text)
    build_noting(recipe, tmp_path / out, progress=False)
    return tmp_path / out


IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def logits(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def gap(path, model) -> float:
    return (logits(path) - logits(model)).abs().max().item()


@pytest.mark.parametrize("family", UPCYCLED)
@pytest.mark.parametrize("granularity", [1, 2])
def test_the_start_reproduces_the_dense_logits(family, granularity, dense, tmp_path):
    model = dense(family)
    router = "virtual_group" if granularity > 1 else "random"  # any router does for m = 1
    out = upcycle(tmp_path, model, granularity=granularity, router=f"{{init: {router}}}")
    assert gap(out, model) < ATOL

    config = json.loads((out / "config.json").read_text())
    source = json.loads((model / "config.json").read_text())
    assert config["model_type"] == LAYOUT[family] and config["num_experts_per_tok"] == 2 * \
        granularity
    assert config.get("num_local_experts", config.get("num_experts")) == 4 * granularity
    width = config.get("moe_intermediate_size", config["intermediate_size"])
    assert width * granularity == source["intermediate_size"]


@pytest.mark.parametrize("granularity,shared", [(2, 1), (4, 1), (4, 2)])
def test_deepseek_shared_expert_isolation_starts_at_the_dense_model(granularity, shared, dense,
                                                                   tmp_path):
    """DeepSeekMoE's fine-grained experts with shared-expert isolation: the first `shared`
    slices of the FFN always on (n_shared_experts), the other slices of each copy routed; the
    start is the dense model, through the shipped modeling code, and fails with a random
    router (a copy's slices chosen apart)."""
    model = dense("llama")
    out = upcycle(tmp_path, model, granularity=granularity, shared_experts=shared)
    config = json.loads((out / "config.json").read_text())
    source = json.loads((model / "config.json").read_text())
    routed = granularity - shared
    width = source["intermediate_size"] // granularity
    assert (config["model_type"], config["n_shared_experts"], config["moe_intermediate_size"],
            config["n_routed_experts"], config["num_experts_per_tok"]) == (
        "deepseek", shared, width, 4 * routed, 2 * routed)
    def remote_gap(path) -> float:  # the shipped modeling code (trust_remote_code)
        remote = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                      trust_remote_code=True).eval()
        with torch.no_grad():
            return (remote(input_ids=IDS).logits - logits(model)).abs().max().item()

    assert remote_gap(out) < ATOL
    with safe_open(out / "model.safetensors", "pt") as f:
        shared_up = f.get_tensor("model.layers.1.mlp.shared_experts.up_proj.weight")
    torch.testing.assert_close(shared_up, dense_ffn(model, 1)[1][:shared * width], atol=0,
                               rtol=0)
    random = upcycle(tmp_path, model, "random", granularity=granularity, shared_experts=shared,
                     router="{init: random}")
    if routed > 1:
        assert remote_gap(random) > 100 * ATOL


def test_shared_experts_need_slices_to_route_and_a_layout_for_them(dense, tmp_path):
    with pytest.raises(RecipeError, match="would leave no slice to route"):
        upcycle(tmp_path, dense("llama"), granularity=2, shared_experts=2)
    with pytest.raises(RecipeError, match="has no shared expert made of expert-width slices"):
        upcycle(tmp_path, dense("qwen2"), granularity=2, shared_experts=1)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_parity_check_can_fail(family, dense, tmp_path):
    """m = 2 with a random router (a copy's two slices are chosen apart), or without the ×m on
    the down slices (the FFN comes out halved): both far from the dense logits."""
    model = dense(family)
    random = upcycle(tmp_path, model, "random", granularity=2, router="{init: random}")
    assert gap(random, model) > 100 * ATOL
    unscaled = upcycle(tmp_path, model, "unscaled", granularity=2)
    file = unscaled / "model.safetensors"
    tensors = load_file(file)
    for name in tensors:
        if name.endswith(("w2.weight", "down_proj.weight")) and ".experts." in name:
            tensors[name] = tensors[name] / 2
    save_file(tensors, file, metadata={"format": "pt"})
    assert gap(unscaled, model) > 100 * ATOL


def expert_copy(out, layout, layer, copy, m):
    """Copy `copy` of layer `layer` put back together: gate, up [I, H]; down [H, I] (÷m)."""
    with safe_open(out / "model.safetensors", "pt") as f:
        def cat(names, dim):
            return torch.cat([f.get_tensor(names.format(layer=layer, e=copy * m + j))
                              for j in range(m)], dim=dim)
        return cat(GATE[layout], 0), cat(UP[layout], 0), cat(DOWN[layout], 1) / m


def dense_ffn(model, layer):
    with safe_open(model / "model.safetensors", "pt") as f:
        return [f.get_tensor(f"model.layers.{layer}.mlp.{p}_proj.weight")
                for p in ("gate", "up", "down")]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_drop_upcycling_redraws_the_same_half_of_the_units(family, dense, tmp_path):
    model = dense(family)
    out = upcycle(tmp_path, model, granularity=2, reinit="{ratio: 0.5, seed: 3}")
    gate, up, down = dense_ffn(model, 1)
    chosen = []
    for copy in range(4):
        g, u, d = expert_copy(out, LAYOUT[family], 1, copy, 2)
        changed = [(a != b).any(dim=dim).nonzero().flatten()
                   for a, b, dim in ((g, gate, 1), (u, up, 1), (d, down, 0))]
        assert torch.equal(changed[0], changed[1]) and torch.equal(changed[0], changed[2])
        assert len(changed[0]) == gate.shape[0] // 2
        # the re-drawn units follow the dense tensor's statistics
        assert abs(g[changed[0]].std().item() / gate.std().item() - 1) < 0.2
        chosen.append(set(changed[0].tolist()))
    assert len({frozenset(c) for c in chosen}) == 4  # each copy its own units
    assert gap(out, model) > 100 * ATOL  # no longer the dense model


def test_same_recipe_same_bytes_and_the_output_generates(dense, tmp_path):
    model = dense("llama")
    fields = {"granularity": 2, "reinit": "{ratio: 0.25}", "noise": 0.01, "seed": 4}
    a = upcycle(tmp_path, model, "a", **fields)
    b = upcycle(tmp_path, model, "b", **fields)
    c = upcycle(tmp_path, model, "c", **{**fields, "seed": 5})
    first = (a / "model.safetensors").read_bytes()
    assert first == (b / "model.safetensors").read_bytes()
    assert first != (c / "model.safetensors").read_bytes()
    generated = AutoModelForCausalLM.from_pretrained(a).generate(
        torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, 7)
    assert "upcycled from the dense" in (a / "README.md").read_text()


def test_granularity_must_divide_the_intermediate_size(dense, tmp_path):
    with pytest.raises(RecipeError, match="granularity: 3 does not divide .* 64"):
        upcycle(tmp_path, dense("llama"), granularity=3)


def test_each_dense_ffn_tensor_is_read_once(dense, tmp_path, monkeypatch):
    """N·m expert slices of a tensor come from one read of it (I/O stays that of one model)."""
    from moemerge.io.reader import CheckpointReader

    reads, original = [], CheckpointReader.read
    monkeypatch.setattr(CheckpointReader, "read",
                        lambda self, name: reads.append(name) or original(self, name))
    upcycle(tmp_path, dense("llama"), granularity=2, reinit="{ratio: 0.5}")
    ffn = [n for n in reads if ".mlp." in n]
    assert len(ffn) == len(set(ffn)) == 2 * 3  # 2 layers × gate, up, down


def test_tune_on_is_refused_naming_the_kind(dense, tmp_path):
    from moemerge.tune import TuneOptions

    recipe = write_recipe(tmp_path / "r.yaml", f"kind: upcycle\nmodel: {dense('llama')}\n"
                          "experts: 2\n")
    with pytest.raises(RecipeError, match=r"r.yaml is kind: upcycle$"):
        build(recipe, tmp_path / "out", tune=TuneOptions(tmp_path / "held_out.txt"))


def test_finetune_defaults_the_balancing_loss_for_upcycled_models_only(dense, tiny_moe,
                                                                       train_text, tmp_path,
                                                                       monkeypatch):
    """0.04 / top-k for an upcycled model whose routers train; 0 for a BTX build, for parts
    without routers, and whenever the config sets it."""
    from moemerge.train import loop
    from moemerge.train.api import finetune
    from moemerge.train.config import make_config

    used = []
    original = loop._loss
    monkeypatch.setattr(loop, "_loss", lambda m, b, coef, ctx: used.append(coef)
                        or original(m, b, coef, ctx))
    up = upcycle(tmp_path, dense("llama"), granularity=2)  # k = 2 copies × 2 slices: top-4

    def coef(model, out, **kw):
        used.clear()
        cfg = make_config(None, {"model": str(model), "output": str(tmp_path / out),
                                 "data": [str(train_text)], "seq_len": 16, "batch_size": 2,
                                 "steps": 1, "device": "cpu"} | kw)
        finetune(cfg)
        saved = yaml.safe_load((tmp_path / out / "training/train_config.yaml").read_text())
        assert used and set(used) == {saved["aux_loss_coef"]}  # the loss used what it records
        return saved["aux_loss_coef"]

    assert coef(up, "full", train=["all"]) == pytest.approx(0.01)
    assert coef(tmp_path / "full", "again", train=["all"]) == pytest.approx(0.01)  # kept
    assert coef(up, "routers") == pytest.approx(0.01)
    assert coef(up, "off", train=["all"], aux_loss_coef=0.0) == 0.0
    assert coef(tiny_moe, "btx", train=["all"]) == 0.0
