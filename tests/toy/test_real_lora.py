"""LoRA experts (moemerge.toy.real_lora) made on a tiny random Llama in seconds: peft loads
each adapter, the record scores every model, an adapter changed the model (its own domain's
held-out perplexity below the base's), and the compute-matched control trains as many steps
as the adapters together."""

import json

import pytest
import torch
from safetensors.torch import load_file

from moemerge.toy.real_lora import (
    CONTROL_FILE,
    LORASET_FILE,
    LoraExpertSpec,
    LoraSet,
    make_lora_control,
    make_lora_experts,
)

peft = pytest.importorskip("peft")

# hidden 32, 2 layers (the model_factory's): 20 steps of 4 × 32 tokens a domain, ~1 s each
SPEC = LoraExpertSpec(base="tiny", domains=("code", "math"), r=4, alpha=8, steps=20, batch=4,
                      seq_len=32, lr=1e-2, train_chars=20_000, eval_chars=4_000,
                      eval_tokens=512)


@pytest.fixture(scope="module")
def lora_set(tmp_path_factory, model_factory):
    torch.set_num_threads(2)
    out = tmp_path_factory.mktemp("lora") / "set"
    make_lora_experts(SPEC, model_factory("llama"), out)
    return LoraSet.load(out)


def test_lora_experts_load_in_peft_and_change_the_model(lora_set):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    record = json.loads((lora_set.root / LORASET_FILE).read_text())
    assert set(lora_set.adapters) == set(SPEC.domains)
    assert lora_set.spec == SPEC and record["tokens_per_adapter"] == 20 * 4 * 32
    assert set(record["perplexity"]) == {"base", "adapter:code", "adapter:math"}
    assert all(set(row) == set(SPEC.domains) for row in record["perplexity"].values())
    for d in SPEC.domains:  # each adapter learned its domain
        assert record["perplexity"][f"adapter:{d}"][d] < record["perplexity"]["base"][d]

    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(lora_set.base, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    for adapter in lora_set.adapters.values():
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["lora_alpha"] == 8
        assert config["base_model_name_or_path"] is None
        assert {t.split(".")[-3] for t in load_file(adapter / "adapter_model.safetensors")
                } == {"gate_proj", "up_proj", "down_proj"}  # ...mlp.up_proj.lora_A.weight
        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(lora_set.base, dtype=torch.float32), adapter)
        factors = [p for n, p in model.named_parameters() if "lora_B" in n]
        assert len(factors) == 2 * 3 and all(p.abs().max() > 0 for p in factors)
        with torch.no_grad():
            assert not torch.allclose(model.eval()(input_ids=ids).logits, base_logits,
                                      atol=1e-3)


def test_lora_control_trains_the_adapters_steps_on_every_domain(lora_set, tmp_path):
    record = make_lora_control(lora_set, tmp_path / "control")
    assert record == json.loads((tmp_path / "control" / CONTROL_FILE).read_text())
    assert record["steps"] == 2 * 20 and record["tokens"] == 2 * 20 * 4 * 32
    assert set(record["perplexity"]) == set(SPEC.domains)
    assert (tmp_path / "control" / "adapter" / "adapter_model.safetensors").is_file()


def test_key_names_the_spec():
    assert LoraExpertSpec().key() == LoraExpertSpec().key() != SPEC.key()
    assert LoraExpertSpec(lr=1e-3).key() != LoraExpertSpec().key()
