"""MoEs moemerge did not build, of every family, in both on-disk forms, through every command:
checkpoints saved by transformers' own classes (tests/moe_families.py).

Oracles: the extracted expert's FFN is the slice of the stack transformers holds in memory
(gate_up_proj[e] split in two, down_proj[e]); shrink to the same K is bit for bit the input,
in its own form; shrink of the fused form equals shrink of the classic form; the outputs load
in transformers and give finite logits."""

from __future__ import annotations

import pytest
import torch
from conftest import TEXT
from moe_families import FAMILIES, hub_moes, logits
from safetensors.torch import load_file
from typer.testing import CliRunner

from moemerge.architectures.forms import CLASSIC, FORMS, FUSED
from moemerge.cli import app
from moemerge.io.reader import CheckpointReader

runner = CliRunner()
# families with a dense transformers class that computes one expert exactly (the others'
# extraction is refused: OLMoE's whole-projection q/k norms, DeepSeek-V2/V3's latent attention)
DENSE_TWIN = {"mixtral": "llama", "qwen3_moe": "qwen3", "flex_olmo": "olmo2",
              "granitemoe": "granite", "granitemoeshared": "granite"}


def run(*args) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def tensors(path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        found |= load_file(file)
    return found


@pytest.fixture(scope="module")
def hub_moe(tmp_path_factory, tokenizer):
    return hub_moes(tmp_path_factory, tokenizer)


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TEXT * 30)
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_loads_in_both_forms_with_the_same_logits(family, hub_moe):
    """transformers 5 reads both forms (the fixture is right); moemerge reads both as one."""
    classic, fused = (logits(hub_moe(family, form)) for form in FORMS)
    assert torch.isfinite(classic).all()
    torch.testing.assert_close(classic, fused, rtol=0, atol=1e-6)  # (qwen2_moe: 1 ulp apart)


@pytest.mark.parametrize("family", sorted(DENSE_TWIN))
def test_extract_is_the_experts_slice_of_the_stack_in_either_form(family, hub_moe, tmp_path):
    expert = 1
    outs = {}
    for form in FORMS:
        code, text = run("extract", hub_moe(family, form), tmp_path / form, "--expert", expert)
        assert code == 0, text
        outs[form] = tensors(tmp_path / form)
    assert outs[CLASSIC].keys() == outs[FUSED].keys()
    assert all(torch.equal(outs[CLASSIC][n], outs[FUSED][n]) for n in outs[CLASSIC])
    block = next(m for name, m in hub_moe.model(family).named_modules()
                 if name.endswith("layers.1.mlp") or name.endswith("layers.1.block_sparse_moe"))
    gate_up, down = block.experts.gate_up_proj[expert], block.experts.down_proj[expert]
    inter = gate_up.shape[0] // 2
    out = outs[FUSED]  # (GraniteMoeShared: the shared MLP's rows and columns follow)
    ffn = {proj: out[f"model.layers.1.mlp.{proj}_proj.weight"] for proj in ("gate", "up", "down")}
    assert torch.equal(ffn["gate"][:inter], gate_up[:inter].detach())
    assert torch.equal(ffn["up"][:inter], gate_up[inter:].detach())
    assert torch.equal(ffn["down"][:, :inter], down.detach())
    assert not torch.equal(ffn["down"][:, :inter], block.experts.down_proj[0].detach())
    assert torch.isfinite(logits(tmp_path / FUSED)).all()


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - set(DENSE_TWIN)))
def test_extract_refuses_a_family_no_dense_model_computes(family, hub_moe, tmp_path):
    """OLMoE and DeepSeek-V2/V3 have no dense twin; Qwen2-MoE's gated shared expert (non-zero
    in every checkpoint but moemerge's shared_expert: none) has no dense equivalent."""
    code, text = run("extract", hub_moe(family, FUSED), tmp_path / "out", "--expert", 0)
    assert code != 0 and family in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shrink_to_the_same_count_is_the_input_bit_for_bit_in_its_own_form(
        family, hub_moe, calib, tmp_path):
    for form in FORMS:
        source = hub_moe(family, form)
        code, text = run("shrink", source, tmp_path / form, "--experts", 3, "--method", "prune",
                         "--calibration", calib)
        assert code == 0, text
        before, after = tensors(source), tensors(tmp_path / form)
        assert before.keys() == after.keys(), form
        assert all(torch.equal(before[n], after[n]) for n in before), form


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "granitemoeshared"])
def test_shrink_of_the_fused_form_is_shrink_of_the_classic_form(family, hub_moe, calib,
                                                                 tmp_path):
    for form in FORMS:
        code, text = run("shrink", hub_moe(family, form), tmp_path / form, "--experts", 2,
                         "--calibration", calib)
        assert code == 0, text
        with CheckpointReader(tmp_path / form) as reader:
            assert reader.form == form and reader.config != {}
    with CheckpointReader(tmp_path / CLASSIC) as a, CheckpointReader(tmp_path / FUSED) as b:
        assert sorted(a.names()) == sorted(b.names())
        assert all(torch.equal(a.read(n), b.read(n)) for n in a.names())
    assert torch.isfinite(logits(tmp_path / FUSED)).all()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inspect_routing_reads_every_family(family, hub_moe, calib):
    code, text = run("inspect", "routing", hub_moe(family, FUSED), "--data", calib)
    assert code == 0, text


@pytest.mark.parametrize("family", ["granitemoeshared", "qwen2_moe"])
def test_extend_refuses_what_cannot_join_a_shared_expert_family(family, hub_moe, calib,
                                                                model_factory, tmp_path):
    """GraniteMoeShared: its extracted expert carries the shared MLP's rows (a wider FFN than
    its experts'); Qwen2-MoE: no expert can be extracted, and another family's model is not
    one of its base. Both refused with exit 1, naming why, nothing written."""
    moe = hub_moe(family, CLASSIC)
    if family == "granitemoeshared":
        code, text = run("extract", moe, tmp_path / "x", "--expert", 0)
        assert code == 0, text
        expert, why = tmp_path / "x", "the MoE's experts' is"
    else:
        expert, why = model_factory("llama"), "not an expert of this MoE's base"
    code, text = run("extend", moe, tmp_path / "out", "--expert", expert,
                     "--calibration", f"{expert.name}={calib}", "--calibration", f"moe={calib}")
    assert code == 1 and why in " ".join(text.split()), text
    assert not (tmp_path / "out").exists()
