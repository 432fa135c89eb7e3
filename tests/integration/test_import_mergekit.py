"""`moemerge import-mergekit` then `moemerge build`: mergekit-shaped configs on tiny models."""

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.merge.dispatch import merge
from moemerge.merge.draws import Draws

runner = CliRunner()


@pytest.fixture
def trio(model_factory, tmp_path):
    base = model_factory("llama")
    return base, [perturbed_copy(base, tmp_path / f"m{i}", scale=0.05, seed=i) for i in range(2)]


def import_and_build(tmp_path, config_text):
    config = write_recipe(tmp_path / "mergekit.yml", config_text)
    result = runner.invoke(app, ["import-mergekit", str(config), "-o", str(tmp_path / "r.yaml")])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["build", str(tmp_path / "r.yaml"), str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    return load_file(tmp_path / "out" / "model.safetensors")


def test_dare_ties_config_builds_with_mergekits_conventions(trio, tmp_path):
    base, (a, b) = trio
    out = import_and_build(tmp_path, f"""
models:
  - model: {base}
  - model: {a}
    parameters: {{density: 0.5, weight: 0.4}}
  - model: {b}
    parameters: {{density: 0.5, weight: 0.3}}
merge_method: dare_ties
base_model: {base}
parameters: {{int8_mask: true}}
dtype: float32
""")
    tensors = [load_file(p / "model.safetensors") for p in (base, a, b)]
    name = "model.layers.0.mlp.up_proj.weight"
    expected = merge("dare_ties", base=tensors[0][name], tensors=[t[name] for t in tensors[1:]],
                     weights=[0.4, 0.3], density=0.5, normalize=False, zero_vote="positive",
                     rescale="l1", draws=Draws.of(0, name))
    torch.testing.assert_close(out[name], expected, atol=0, rtol=0)


def test_slerp_slices_config_builds(trio, tmp_path):
    base, (a, b) = trio
    out = import_and_build(tmp_path, f"""
slices:
  - sources:
      - model: {b}
        layer_range: [0, 2]
      - model: {a}
        layer_range: [0, 2]
merge_method: slerp
base_model: {a}
parameters:
  t:
    - filter: self_attn
      value: [0, 1]
    - value: 0
dtype: float32
""")
    # the base (a) is t = 0: attention goes from a (layer 0) to b (layer 1), the rest stays a
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    for name, source in (("model.layers.0.self_attn.q_proj.weight", ta),
                         ("model.layers.1.self_attn.q_proj.weight", tb),
                         ("model.layers.1.mlp.up_proj.weight", ta)):
        torch.testing.assert_close(out[name], source[name], atol=1e-6, rtol=0)


def test_mergekit_moe_config_builds_a_mixtral(trio, tmp_path):
    base, (a, b) = trio
    out = import_and_build(tmp_path, f"""
base_model: {base}
gate_mode: cheap_embed
experts:
  - source_model: {a}
    positive_prompts: ["def add(a, b):"]
  - source_model: {b}
    positive_prompts: ["The sum of two numbers."]
""")
    source = load_file(base / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(out[name], source[name])  # mergekit-moe copies the base's attention
    assert "model.layers.0.block_sparse_moe.experts.1.w1.weight" in out


def average(ts, ws):
    return sum(w * t for w, t in zip(ws, ts, strict=True)) / sum(ws)


def check_linear(out, t, name):  # weights 1, 0.3, 0.5 of base, a, b
    for key in t["base"]:
        torch.testing.assert_close(out[key], average([t["base"][key], t["a"][key], t["b"][key]],
                                                     [1.0, 0.3, 0.5]), atol=1e-6, rtol=0)


def check_passthrough(out, t, name):  # a's layers [0, 2) then b's [1, 2): 3 layers
    assert torch.equal(out[name.format(1)], t["a"][name.format(1)])
    assert torch.equal(out[name.format(2)], t["b"][name.format(1)])
    assert torch.equal(out["model.norm.weight"], t["b"]["model.norm.weight"])


def check_task_arithmetic(out, t, name):  # base + 0.8 (0.5 τa + 0.5 τb): not normalised
    for key in t["base"]:
        base = t["base"][key]
        expected = base + 0.8 * (0.5 * (t["a"][key] - base) + 0.5 * (t["b"][key] - base))
        torch.testing.assert_close(out[key], expected, atol=1e-6, rtol=0)


def check_model_stock(out, t, name):  # t · mean + (1 − t) base, t = 2 cos / (1 + cos), N = 2
    name = name.format(1)
    base, a, b = (t[k][name] for k in ("base", "a", "b"))
    cos = torch.nn.functional.cosine_similarity((a - base).flatten(), (b - base).flatten(), dim=0)
    ratio = 2 * cos / (1 + cos)
    torch.testing.assert_close(out[name], ratio * (a + b) / 2 + (1 - ratio) * base, atol=1e-6,
                               rtol=0)


def check_karcher(out, t, name):  # two directions: their normalised midpoint, mean norm
    name = name.format(1)
    a, b = t["a"][name], t["b"][name]
    mid = a / a.norm() + b / b.norm()
    torch.testing.assert_close(out[name], mid / mid.norm() * (a.norm() + b.norm()) / 2,
                               atol=1e-6, rtol=0)


def as_mergekit(method, **params):
    """Expected: the method's function with mergekit's conventions (docs/mergekit.md), the
    parameters the config gives and, where it gives none, mergekit's defaults."""
    def check(out, t, name):
        name = name.format(1)
        expected = merge(method, base=t["base"][name], tensors=[t["a"][name], t["b"][name]],
                         draws=Draws.of(0, name), **params)
        torch.testing.assert_close(out[name], expected, atol=0, rtol=0)
    return check


MK_TIES = {"trim_rounding": "sort", "zero_vote": "positive"}
# mergekit's documented config shapes (docs/mergekit.md), on the tiny models
SHAPES = {
    "linear": ("""
models:
  - {{model: {base}, parameters: {{weight: 1.0}}}}
  - {{model: {a}, parameters: {{weight: 0.3}}}}
  - {{model: {b}, parameters: {{weight: 0.5}}}}
merge_method: linear
""", check_linear),
    "passthrough": ("""
slices:
  - sources: [{{model: {a}, layer_range: [0, 2]}}]
  - sources: [{{model: {b}, layer_range: [1, 2]}}]
merge_method: passthrough
""", check_passthrough),
    "task_arithmetic": ("""
base_model: {base}
models: [{{model: {a}, parameters: {{weight: 0.5}}}}, {{model: {b}, parameters: {{weight: 0.5}}}}]
merge_method: task_arithmetic
parameters: {{lambda: 0.8}}
""", check_task_arithmetic),
    "ties": ("""
models:
  - model: {base}
  - {{model: {a}, parameters: {{density: 0.5, weight: 0.5}}}}
  - {{model: {b}, parameters: {{density: 0.5, weight: 0.3}}}}
merge_method: ties
base_model: {base}
parameters: {{normalize: true}}
""", as_mergekit("ties", weights=[0.5, 0.3], density=0.5, **MK_TIES)),
    "ties, no density (mergekit keeps everything)": ("""
models: [{{model: {a}, parameters: {{weight: 1}}}}, {{model: {b}, parameters: {{weight: 1}}}}]
merge_method: ties
base_model: {base}
""", as_mergekit("ties", density=1.0, **MK_TIES)),
    "della": ("""
models:
  - {{model: {a}, parameters: {{weight: 1, density: 0.6, epsilon: 0.2}}}}
  - {{model: {b}, parameters: {{weight: 1, density: 0.6, epsilon: 0.2}}}}
merge_method: della
base_model: {base}
parameters: {{lambda: 1.0}}
""", as_mergekit("della", density=0.6, epsilon=0.2, rescale="l1", zero_vote="positive")),
    "breadcrumbs_ties": ("""
models:
  - {{model: {a}, parameters: {{weight: 1, density: 0.9, gamma: 0.01}}}}
  - {{model: {b}, parameters: {{weight: 1, density: 0.9, gamma: 0.01}}}}
merge_method: breadcrumbs_ties
base_model: {base}
""", as_mergekit("breadcrumbs_ties", density=0.9, gamma=0.01, normalize=False, **MK_TIES)),
    "sce": ("""
models: [{{model: {a}}}, {{model: {b}}}]
merge_method: sce
base_model: {base}
parameters: {{select_topk: 0.1}}
""", as_mergekit("sce", select_topk=0.1, zero_vote="positive")),
    "model_stock": ("""
models: [{{model: {a}}}, {{model: {b}}}]
merge_method: model_stock
base_model: {base}
""", check_model_stock),
    "karcher": ("""
models: [{{model: {a}}}, {{model: {b}}}]
merge_method: karcher
parameters: {{max_iter: 20, tol: 1.0e-6}}
""", check_karcher),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_documented_shapes_build_and_load(shape, trio, tmp_path):
    base, (a, b) = trio
    config, check = SHAPES[shape]
    out = import_and_build(tmp_path, config.format(base=base, a=a, b=b) + "dtype: float32\n")
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # loads in transformers
    tensors = {k: load_file(p / "model.safetensors") for k, p in (("base", base), ("a", a),
                                                                  ("b", b))}
    check(out, tensors, "model.layers.{}.self_attn.o_proj.weight")


def test_mergekit_moe_hidden_gates_build(trio, tmp_path):
    base, (a, b) = trio
    out = import_and_build(tmp_path, f"""
base_model: {base}
gate_mode: hidden
dtype: float32
experts:
  - {{source_model: {a}, positive_prompts: ["def add(a, b):"]}}
  - {{source_model: {b}, positive_prompts: ["The sum"], negative_prompts: ["def add"]}}
""")
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    sources = [load_file(p / "model.safetensors") for p in (base, a, b)]
    name = "model.layers.1.self_attn.o_proj.weight"
    assert torch.equal(out[name], sources[0][name])  # attention: the base's
    for e in range(2):  # expert e's FFN is model e's
        assert torch.equal(out[f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight"],
                           sources[e + 1]["model.layers.1.mlp.down_proj.weight"])
    assert out["model.layers.1.block_sparse_moe.gate.weight"].shape == (2, 32)


def test_a_norm_filter_selects_qwen3_q_norm_as_in_mergekit(model_factory, tmp_path):
    # mergekit's "norm" filter is a substring: it also selects self_attn.q_norm / k_norm, which
    # moemerge's roles count as attn; the import selects the same tensors by name
    base = model_factory("qwen3")
    a, b = (perturbed_copy(base, tmp_path / f"q{i}", scale=0.05, seed=i) for i in range(2))
    out = import_and_build(tmp_path, f"""
models: [{{model: {a}}}, {{model: {b}}}]
merge_method: slerp
base_model: {a}
parameters:
  t: [{{filter: norm, value: 1}}, {{value: 0}}]
dtype: float32
""")
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    for name, source in (("model.layers.0.self_attn.q_norm.weight", tb),
                         ("model.layers.1.self_attn.k_norm.weight", tb),
                         ("model.layers.0.input_layernorm.weight", tb),
                         ("model.norm.weight", tb),
                         ("model.layers.0.self_attn.q_proj.weight", ta)):
        torch.testing.assert_close(out[name], source[name], atol=1e-6, rtol=0)


def test_prints_without_output_and_refuses_an_existing_file(trio, tmp_path):
    base, (a, b) = trio
    config = write_recipe(tmp_path / "c.yml", f"models: [{{model: {a}}}, {{model: {b}}}]\n"
                          "merge_method: linear\n")
    result = runner.invoke(app, ["import-mergekit", str(config)])
    assert result.exit_code == 0 and "method: average" in result.output
    existing = write_recipe(tmp_path / "r.yaml", "x")
    result = runner.invoke(app, ["import-mergekit", str(config), "-o", str(existing)])
    assert result.exit_code == 1 and "already exists" in result.output
    bad = write_recipe(tmp_path / "bad.yml", "merge_method: blend\nmodels: [{model: x}]\n")
    result = runner.invoke(app, ["import-mergekit", str(bad)])
    assert result.exit_code == 2 and "blend" in result.output
