"""`assembly: lora_experts`: an MoE whose experts stay LoRA adapters of one base
(modeling_lora_moemerge.py), against peft itself.

Each adapter is made with peft's `LoraConfig` / `get_peft_model` (random A and B, so every
delta is non-zero) on a tiny model. The oracle: with every token sent to expert e the MoE's
logits are those of peft's `PeftModel` of adapter e (and of its `merge_and_unload()`); top-k
routing is a plainly written reference over the per-expert peft deltas; a wrong scale or a
wrong expert is shown to fail the comparison."""

import json

import pytest
import torch
import yaml
from conftest import generate_in_fresh_process
from lora_adapters import IDS, LINEARS, build, load, logits, make_adapter
from safetensors.torch import load_file
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.errors import MismatchError, RecipeError

peft = pytest.importorskip("peft")

LOGITS = dict(atol=2e-5, rtol=1e-4)  # the unmerged sums in another order
FFN = ["gate_proj", "up_proj", "down_proj"]


def recipe_of(base, adapters, **fields) -> dict:
    return {"kind": "moe", "assembly": "lora_experts", "base_model": str(base),
            "experts": [{"model": str(base), "lora": str(a), "name": f"e{i}"}
                        for i, a in enumerate(adapters)], **fields}


@pytest.fixture(scope="module")
def llama(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    """Three distinct adapters: all linears, r 4; FFN only with a rank pattern (r 2 / 6) and
    rsLoRA; attention only, r 3."""
    root = tmp_path_factory.mktemp("lora-experts")
    return [make_adapter(llama, root / "all", seed=1, r=4, lora_alpha=8, target_modules=LINEARS),
            make_adapter(llama, root / "ffn", seed=2, r=2, lora_alpha=5, use_rslora=True,
                         target_modules=FFN, rank_pattern={"down_proj": 6}),
            make_adapter(llama, root / "attn", seed=3, r=3, lora_alpha=3,
                         target_modules=["q_proj", "v_proj"])]


@pytest.fixture(scope="module")
def built(llama, adapters, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("built")
    build(tmp, recipe_of(llama, adapters, experts_per_token=2))
    return tmp / "out"


def test_each_expert_alone_is_peft(llama, adapters, built):
    model = load(built)
    for e, adapter in enumerate(adapters):
        model.route_to(e)
        want = peft.PeftModel.from_pretrained(load(llama), adapter).eval()
        got = logits(model)
        torch.testing.assert_close(got, logits(want), **LOGITS)
        torch.testing.assert_close(got, logits(want.merge_and_unload()), **LOGITS)
        # the comparison can fail: another expert, or the base, is far from it
        model.route_to((e + 1) % len(adapters))
        assert (logits(model) - got).abs().max() > 1e-3
    assert (logits(load(llama)) - got).abs().max() > 1e-3


def test_top_k_mixes_the_peft_deltas_by_the_routers_weights(llama, adapters, built):
    """Every targeted linear: x Wᵀ + Σ_e g_e (peft's delta of adapter e), g the top-2 of the
    block router's softmax, renormalised; written plainly, module by module, with peft's own
    lora_A / lora_B / scaling."""
    model, base = load(built), load(llama)
    peft_models = [peft.PeftModel.from_pretrained(load(llama), a).eval() for a in adapters]
    captured = {}

    def keep(name):
        def hook(_module, args, kwargs):
            captured[name] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    for name in model.router_modules():
        block = model.get_submodule(name.rsplit(".", 1)[0])
        block.register_forward_pre_hook(keep(name), with_kwargs=True)
    logits(model)
    for name, router in model.router_modules().items():
        h = captured[name]
        probs = torch.softmax(h @ router.weight.T, -1)
        top, index = probs.topk(2, -1)
        gates = torch.zeros_like(probs).scatter(-1, index, top / top.sum(-1, keepdim=True))
        block = name.rsplit(".", 1)[0]
        leaf = "gate_proj" if block.endswith("mlp") else "q_proj"
        x = h  # the block's input is its first linear's
        want = x @ base.get_submodule(f"{block}.{leaf}").weight.T
        for e, pm in enumerate(peft_models):
            layer = pm.base_model.model.get_submodule(f"{block}.{leaf}")
            if not hasattr(layer, "lora_A"):
                continue
            delta = layer.lora_B["default"](layer.lora_A["default"](x)) * layer.scaling["default"]
            want = want + gates[..., e:e + 1] * delta
        got = model.get_submodule(f"{block}.{leaf}")(x)
        torch.testing.assert_close(got, want, **LOGITS)
        assert (gates > 0).sum(-1).eq(2).all()


def test_output_is_the_base_once_plus_the_adapters(llama, adapters, built):
    got = load_file(built / "model.safetensors")
    base = load_file(llama / "model.safetensors")
    for name, tensor in base.items():  # the base's tensors, unchanged
        assert torch.equal(got[name], tensor), name
    config = json.loads((built / "config.json").read_text())
    assert config["lora_ranks"]["model.layers.0.mlp.down_proj"] == 6  # the largest rank
    assert config["lora_ranks"]["model.layers.0.self_attn.q_proj"] == 4
    assert got["model.layers.0.mlp.down_proj.lora_A"].shape[:2] == (3, 6)
    # expert 2 (attention only) has zero factors in the FFN
    assert not got["model.layers.0.mlp.gate_proj.lora_A"][2].any()
    extra = sum(t.numel() for n, t in got.items() if n not in base)
    factors = sum(t.numel() for a in adapters
                  for t in load_file(a / "adapter_model.safetensors").values())
    assert factors <= extra < 2 * factors + 10_000  # padding and routers on top


def test_a_fresh_offline_process_loads_the_shipped_code_and_generates(built, tmp_path):
    assert generate_in_fresh_process(built, tmp_path) == ["8", "moemerge_lora"]


def test_generation_through_the_cache_is_the_full_forward(built):
    """Token routing needs no state between steps: greedy decoding's last logits equal a
    full forward over the generated sequence."""
    model = load(built)
    out = model.generate(IDS[:1, :6], max_new_tokens=5, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        full = model(input_ids=out.sequences[:, :-1]).logits[:, -1]
    torch.testing.assert_close(out.logits[-1], full, **LOGITS)


def test_bad_experts_are_refused(llama, adapters, tmp_path):
    with pytest.raises(RecipeError, match="experts.0: .* has no LoRA adapter"):
        build(tmp_path, {**recipe_of(llama, adapters[:1]), "experts": [str(llama)]})
    moved = recipe_of(llama, adapters[:2])
    moved["experts"][1]["model"] = str(tmp_path)
    with pytest.raises(RecipeError, match="experts.1: the adapter is put on"):
        build(tmp_path, moved)
    with pytest.raises(RecipeError, match="experts_per_token: 3 is not between 1 and"):
        build(tmp_path, recipe_of(llama, adapters[:2], experts_per_token=3))
    saved = make_adapter(llama, tmp_path / "saved", seed=4, r=2, lora_alpha=2,
                         target_modules=["q_proj"], modules_to_save=["lm_head"])
    with pytest.raises(MismatchError, match="replaces whole tensors .*lm_head"):
        build(tmp_path, recipe_of(llama, [adapters[0], saved]))
    embed = make_adapter(llama, tmp_path / "embed", seed=5, r=2, lora_alpha=2,
                         target_modules=["embed_tokens"])
    with pytest.raises(MismatchError, match="has an embedding LoRA"):
        build(tmp_path, recipe_of(llama, [adapters[0], embed]))


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture(scope="module")
def domains(tmp_path_factory):
    """Two texts the tiny tokenizer cuts into different tokens."""
    root = tmp_path_factory.mktemp("domains")
    (root / "e0.txt").write_text("def add(a, b):\n    return a + b\n" * 60)
    (root / "e1.txt").write_text("The sum of two numbers. Q: What is 2 + 3? A: 5.\n" * 60)
    return root


@pytest.fixture(scope="module")
def calibrated(llama, adapters, domains, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("calibrated")
    recipe = recipe_of(llama, adapters[:2], experts_per_token=1, router={"init": "calibrate"},
                       calibration={"data": [f"e{i}={domains / f'e{i}.txt'}" for i in range(2)],
                                    "seq_len": 16, "max_tokens": 512})
    build(tmp, recipe)
    return tmp / "out"


def test_calibrated_routers_send_each_text_to_its_adapter(calibrated, domains):
    from moemerge.analysis.routing import routing_report
    from moemerge.loading import load_causal_lm

    model, tokenizer = load_causal_lm(calibrated)
    texts = {f"e{i}": (domains / f"e{i}.txt").read_text() for i in range(2)}
    report = routing_report(model, tokenizer, texts, seq_len=16, max_tokens=512,
                            labels=["e0", "e1"])
    for i, domain in enumerate(("e0", "e1")):
        share = [row[i] for row in report.domains[domain].share]  # per layer, own expert
        assert min(share) >= 0.9, (domain, share)
    # every block's router was fitted (the attention's too): none is still the placeholder,
    # the random router of the same seed and name
    fitted = load_file(calibrated / "model.safetensors")
    recipe = yaml.safe_load((calibrated / "moemerge_recipe.yaml").read_text())
    recipe = {**recipe, "router": {"init": "random"}}
    recipe.pop("calibration")
    build(calibrated.parent, recipe, name="random")
    placeholder = load_file(calibrated.parent / "random" / "model.safetensors")
    names = [f"{n}.weight" for n in model.router_modules()]
    assert any(".self_attn." in n for n in names)
    for name in names:
        assert (fitted[name] - placeholder[name]).abs().max() > 1e-3, name


def test_prompts_init_reads_each_blocks_own_input(llama, adapters, tmp_path):
    recipe = recipe_of(llama, adapters, router={"init": "prompts"})
    for i, expert in enumerate(recipe["experts"]):
        expert["positive_prompts"] = [["def f(x):", "The cat sat.", "Q: 1 + 1? A: 2"][i]]
    build(tmp_path, recipe)
    got = load_file(tmp_path / "out" / "model.safetensors")
    attn, mlp = (got[f"model.layers.0.{b}.router.weight"] for b in ("self_attn", "mlp"))
    assert attn.abs().max() > 0 and mlp.abs().max() > 0
    assert (attn - mlp).abs().max() > 1e-3  # the attention's input is not the MLP's


def test_finetune_trains_the_routers_only(built, domains, tmp_path):
    code, output = run("finetune", built, tmp_path / "tuned", "--data", domains / "e0.txt",
                       "--router-only", "--steps", 2, "--seq-len", 16, "--batch-size", 2,
                       "--lr", 1e-2, "-q")
    assert code == 0, output
    before, after = (load_file(p / "model.safetensors") for p in (built, tmp_path / "tuned"))
    assert set(before) == set(after)
    for name in before:
        changed = not torch.equal(before[name], after[name])
        assert changed == name.endswith(".router.weight"), name
    code, output = run("finetune", built, tmp_path / "aux", "--data", domains / "e0.txt",
                       "--aux-loss-coef", 0.01, "--steps", 1, "-q")
    assert code == 2 and "no load-balancing loss" in output, output


def test_extract_gives_the_expert_as_peft_would(llama, adapters, built, tmp_path):
    """Dense: peft's merge_and_unload(). --lora stored: the adapter, which peft loads and runs
    to the same logits (ranks trimmed back from the padded stack)."""
    code, output = run("extract", built, tmp_path / "dense", "--expert", "e1")
    assert code == 0, output
    want = peft.PeftModel.from_pretrained(load(llama), adapters[1]).eval()
    torch.testing.assert_close(logits(load(tmp_path / "dense")), logits(want), **LOGITS)
    code, output = run("extract", built, tmp_path / "adapter", "--expert", "e1", "--lora",
                       "stored")
    assert code == 0, output
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(llama)
    assert config["r"] == 6 and sorted(config["target_modules"]) == sorted(FFN)
    again = peft.PeftModel.from_pretrained(load(llama), tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(again), logits(want), **LOGITS)
    other = peft.PeftModel.from_pretrained(load(llama), adapters[0]).eval()
    assert (logits(again) - logits(other)).abs().max() > 1e-3
    code, output = run("extract", llama, tmp_path / "x", "--expert", "0", "--lora", "stored")
    assert code == 2 and "`moemerge extract --lora stored` takes only lora_experts" \
        in output, output


def test_extract_lora_rank_refits_an_expert_as_any_moes(llama, adapters, built, tmp_path):
    """--lora RANK on an expert of an MoE of LoRA experts: its dense weights (the base with the
    adapter merged) fitted again by SVD, as for any MoE's expert (it was refused as "a dense
    model" before the kinds table read it back). At the stored rank the SVD is exact: peft's
    logits of the original adapter; at rank 1 of a rank-4 adapter it is not."""
    want = peft.PeftModel.from_pretrained(load(llama), adapters[0]).eval()
    for rank, exact in (("4", True), ("1", False)):
        out = tmp_path / f"r{rank}"
        code, output = run("extract", built, out, "--expert", "e0", "--lora", rank, "--base",
                           llama)
        assert code == 0, output
        got = logits(peft.PeftModel.from_pretrained(load(llama), out).eval())
        assert torch.allclose(got, logits(want), **LOGITS) == exact, rank


def test_dry_run_says_what_each_stack_is_made_of(llama, adapters, tmp_path):
    result, _ = build(tmp_path, recipe_of(llama, adapters), dry_run=True)
    lines = {j.output: result.plan.describe_job(j) for j in result.plan.jobs}
    assert lines["model.layers.0.mlp.down_proj.weight"].startswith("copy base:")  # bytes
    stack = lines["model.layers.0.mlp.down_proj.lora_B"]
    assert stack.startswith("fuse 3 × [copy e0:model.layers.0.mlp.down_proj.weight as LoRA B × "
                            "2 (r=4, zero-padded to 6)"), stack
    assert "= base + LoRA" not in stack  # the factor is read, not the merged weight
    assert lines["model.layers.0.mlp.router.weight"] == "router init=random"
    assert result.plan.making_bytes == 0


@pytest.mark.parametrize("family, options", [
    ("qwen2", {}),  # biased q / k / v projections under the LoRA
    ("qwen3", {}),  # q_norm / k_norm
    ("mistral", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama", {"dtype": torch.bfloat16}),
], ids=["qwen2", "qwen3", "mistral", "tied", "bf16"])
def test_each_family_expert_alone_is_peft(family, options, model_factory, tmp_path):
    base = model_factory(family, **options)
    adapters = [make_adapter(base, tmp_path / f"a{i}", seed=10 + i, r=2 + i, lora_alpha=4,
                             target_modules=LINEARS[i * 2:i * 2 + 4]) for i in range(2)]
    build(tmp_path, recipe_of(base, adapters))
    out = tmp_path / "out"
    stored = load_file(out / "model.safetensors")
    assert ("lm_head.weight" in stored) == (not options.get("tie_word_embeddings"))
    dtype = options.get("dtype", torch.float32)
    assert stored["model.layers.0.self_attn.q_proj.lora_A"].dtype == dtype
    model = load(out)
    tolerance = LOGITS if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    for e, adapter in enumerate(adapters):
        model.route_to(e)
        want = logits(peft.PeftModel.from_pretrained(load(base), adapter).eval())
        torch.testing.assert_close(logits(model), want, **tolerance)
        assert (logits(load(base)) - want).abs().max() > 3 * tolerance["atol"]


def test_families_whose_head_moemerge_does_not_run_are_refused(model_factory, tmp_path):
    """Granite scales its logits in its own ForCausalLM (logits_scaling), outside the decoder
    stack this kind's modeling code keeps: refused, naming the assemblies it feeds."""
    base = model_factory("granite")
    adapter = make_adapter(base, tmp_path / "a", seed=0, r=2, lora_alpha=2,
                           target_modules=["q_proj"])
    with pytest.raises(MismatchError, match="into assembly token_routed only"):
        build(tmp_path, recipe_of(base, [adapter], experts_per_token=1))


def test_all_mixes_every_adapter_by_the_softmax(llama, adapters, tmp_path):
    build(tmp_path, recipe_of(llama, adapters, experts_per_token="all"))
    model = load(tmp_path / "out")
    assert model.config.experts_per_token == 3
    logits(model)
    for router in model.router_modules().values():
        assert (router.gates > 0).all()
        torch.testing.assert_close(router.gates.sum(-1), torch.ones(router.gates.shape[:-1]))
