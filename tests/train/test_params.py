"""Trained tensors back to the checkpoint's own names, on either transformers major: 5 converts
Mixtral's experts at load (fused gate_up_proj / down_proj under mlp.experts) and
`to_disk_names` reverts that through transformers' own reverse; 4 loads the classic names, and
the fallback keeps them."""

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from moemerge.errors import OutputError
from moemerge.train.params import to_disk_names

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
