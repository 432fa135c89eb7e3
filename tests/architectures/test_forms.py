"""Both on-disk forms of every MoE family read as one: the fused checkpoint's classic view holds
the same names, shapes, dtypes and bytes as what save_pretrained writes of the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_families import FAMILIES, save_moe, tiny_moe_model
from safetensors import safe_open

from moemerge.architectures.forms import CLASSIC, FUSED, classic_view
from moemerge.errors import CheckpointError, MismatchError
from moemerge.io.reader import CheckpointReader, read_safetensors_header


@pytest.fixture(scope="module")
def both_forms(tmp_path_factory):
    made = {}

    def make(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            model = tiny_moe_model(family)
            made[family] = (save_moe(model, root / CLASSIC, CLASSIC),
                            save_moe(model, root / FUSED, FUSED))
        return made[family]

    return make


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_fused_form_reads_as_the_classic_one_byte_for_byte(family, both_forms):
    classic_dir, fused_dir = both_forms(family)
    with CheckpointReader(classic_dir) as classic, CheckpointReader(fused_dir) as fused:
        assert (classic.form, fused.form) == (CLASSIC, FUSED)
        assert sorted(classic.names()) == sorted(fused.names())
        for name in classic.names():
            a, b = classic.read(name), fused.read(name)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), name
            assert torch.equal(a, b), name


def test_an_expert_of_a_fused_stack_is_its_own_byte_range(both_forms):
    """Expert 1's up rows of layer 0 are bytes of gate_up_proj [E, 2I, H] at (1·2I + I)·H: the
    writer can copy them, and a wrong offset (expert 2's) would read other values."""
    _, fused_dir = both_forms("mixtral")
    with CheckpointReader(fused_dir) as reader:
        meta = reader.meta("model.layers.0.block_sparse_moe.experts.1.w3.weight")
        stack = "model.layers.0.mlp.experts.gate_up_proj"
        assert stack not in reader
        with safe_open(fused_dir / "model.safetensors", "pt") as f:
            whole = f.get_tensor(stack)
        inter = whole.shape[1] // 2
        assert torch.equal(reader.read(meta.name), whole[1, inter:])
        assert not torch.equal(reader.read(meta.name), whole[2, inter:])
        assert reader.stored(meta.name) is meta and meta.shape == (inter, whole.shape[2])


def test_a_tensor_in_neither_form_is_named(both_forms):
    """A third naming (experts.gate_proj stacked alone) is refused, naming the tensor and the
    two forms the layout has, not merged as if it were a dense tensor."""
    _, fused_dir = both_forms("qwen3_moe")
    with CheckpointReader(fused_dir) as reader:
        config, metas = reader.config, dict(reader.metas)
    odd = "model.layers.0.mlp.experts.gate_proj"
    metas[odd] = metas.pop("model.layers.0.mlp.experts.0.gate_proj.weight")
    with pytest.raises(MismatchError) as err:
        classic_view(config, metas, "moe")
    assert odd in str(err.value) and "classic" in str(err.value) and \
        "model.layers.0.mlp.experts.gate_up_proj" in str(err.value)


def test_a_stack_of_the_wrong_expert_count_is_named(both_forms):
    _, fused_dir = both_forms("olmoe")
    config = json.loads((fused_dir / "config.json").read_text())
    config["num_experts"] = 4
    raw = read_safetensors_header(fused_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"experts\.\w+_proj has shape \[3, .*"
                                              r"num_experts = 4"):
        classic_view(config, raw, "moe")


def test_both_forms_in_one_checkpoint_are_refused(both_forms):
    classic_dir, fused_dir = both_forms("qwen2_moe")
    raw = read_safetensors_header(fused_dir / "model.safetensors")
    extra = read_safetensors_header(classic_dir / "model.safetensors")
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    raw[name] = extra[name]
    config = json.loads((fused_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="both forms in one checkpoint"):
        classic_view(config, raw, "moe")


MERGEKIT = Path(__file__).parents[1] / "data" / "mergekit-moe-0.1.5"


def test_what_mergekit_0_1_5_writes_is_read_as_the_fused_form(tmp_path):
    """mergekit-moe 0.1.5's Mixtral (its header and config.json, kept in tests/data), random
    values under that exact header: read as fused, every classic name of a 3-expert Mixtral
    present, and expert 2's w3 the up rows of its stack."""
    from moemerge.architectures.tables import moe_layouts

    header = json.loads((MERGEKIT / "header.json").read_text())
    size = max(entry["data_offsets"][1] for name, entry in header.items()
               if name != "__metadata__")
    raw = json.dumps(header).encode()
    values = torch.randn(size // 4, generator=torch.Generator().manual_seed(0)) * 0.05
    (tmp_path / "model.safetensors").write_bytes(
        len(raw).to_bytes(8, "little") + raw + values.numpy().tobytes())
    (tmp_path / "config.json").write_bytes((MERGEKIT / "config.json").read_bytes())
    layout = moe_layouts()["mixtral"]
    with CheckpointReader(tmp_path) as reader:
        assert reader.form == FUSED
        expected = {layout.expert_name(layer, e, p) for layer in range(2) for e in range(3)
                    for p in ("gate", "up", "down")} | {layout.router_name(0)}
        assert expected <= set(reader.names())
        with safe_open(tmp_path / "model.safetensors", "pt") as f:
            stack = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")
        up = reader.read(layout.expert_name(1, 2, "up"))
        assert torch.equal(up, stack[2, stack.shape[1] // 2:])
