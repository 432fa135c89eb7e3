"""Trained tensors back to the checkpoint's own names, on either transformers major: 5 converts
Mixtral's experts at load (fused gate_up_proj / down_proj under mlp.experts) and
`to_disk_names` reverts that through transformers' own reverse; 4 loads the classic names, and
the fallback keeps them."""

import pytest
import torch
import transformers
from conftest import needs_class, write_recipe
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.errors import OutputError
from moemerge.train.params import router_modules, select_trainable, to_disk_names

MAJOR = int(transformers.__version__.split(".")[0])


def test_in_memory_parameters_map_to_the_classic_on_disk_tensors(tiny_moe):
    stored = load_file(tiny_moe / "model.safetensors")
    disk = {n: (t.dtype, tuple(t.shape)) for n, t in stored.items()}
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    params = {n: p.detach() for n, p in model.named_parameters()}
    # the path under test: transformers 5 fuses the experts in memory, 4 does not
    assert any(n.endswith("experts.gate_up_proj") for n in params) == (MAJOR >= 5)
    mapped = to_disk_names(model, params, disk)
    assert set(mapped) == set(stored)
    assert "model.layers.1.block_sparse_moe.experts.1.w3.weight" in mapped
    for name, tensor in mapped.items():
        assert torch.equal(tensor, stored[name].float()), name


def test_a_parameter_the_checkpoint_lacks_is_named(tiny_moe):
    stored = load_file(tiny_moe / "model.safetensors")
    disk = {n: (t.dtype, tuple(t.shape)) for n, t in stored.items()}
    model = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    with pytest.raises(OutputError, match="'model.extra.weight' has no counterpart"):
        to_disk_names(model, {"model.extra.weight": torch.zeros(2)}, disk)


@pytest.mark.parametrize("family,router", [
    pytest.param("granite", "model.layers.{}.block_sparse_moe.router.layer.weight",
                 marks=pytest.mark.skipif(MAJOR < 5, reason="transformers 4's GraniteMoE has "
                                          "no `experts` module")),
    pytest.param("olmo2", "model.layers.{}.mlp.gate.weight",
                 marks=needs_class("FlexOlmoForCausalLM")),
])
def test_new_layouts_train_their_routers_under_the_disk_names(family, router, model_factory,
                                                              tmp_path):
    """GraniteMoE's router is a `router` module (Mixtral's and FlexOlmo's a `gate`), its experts
    fused on disk: the routers are found, one per layer, and every parameter maps back."""
    dense = model_factory(family)
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: moe\nbase_model: {dense}\n"
                          f"experts: [{dense}, {dense}]\n")
    build(recipe, tmp_path / "moe", progress=False)
    stored = load_file(tmp_path / "moe" / "model.safetensors")
    disk = {n: (t.dtype, tuple(t.shape)) for n, t in stored.items()}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32)
    assert len(router_modules(model)) == 2
    params = {n: p.detach() for n, p in model.named_parameters()}
    trained = select_trainable(model, ["routers"], "moe")
    assert set(to_disk_names(model, {n: params[n] for n in trained}, disk)) == {
        router.format(layer) for layer in range(2)}
    mapped = to_disk_names(model, params, disk)
    assert set(mapped) == set(stored)
    for name, tensor in mapped.items():
        assert torch.equal(tensor, stored[name].float()), name
