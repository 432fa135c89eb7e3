"""`moemerge extend` of seq_routed and merged_experts MoEs: two experts grown by a third, compared
with a from-scratch build of the recipe copy extend writes (every tensor bit for bit, the
routers within 1e-6 relative), and the new expert checked against a plain reference: the MoE
forced to it computes the new expert's own dense logits. Three planted domains, three distinct
perturbed experts (test_extend.py's)."""

import json
import time

import pytest
import torch
from conftest import build_noting, generate_in_fresh_process, perturbed_copy, write_recipe
from safetensors.torch import load_file, save_file
from test_extend import ALPHABETS, planted_text, relative, tensors
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moemerge.api import build
from moemerge.cli import app
from moemerge.io.atomic import RECIPE_COPY
from moemerge.loading import load_pretrained

IDS = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
ROUTERS = ("router.weight",)  # seq_routed's; merged_experts': `.mlp.router.weight` per layer


@pytest.fixture(scope="module")
def sources(model_factory, tmp_path_factory):
    """(root, base, {domain: expert}): every tensor perturbed (attention too), planted texts."""
    root = tmp_path_factory.mktemp("extend-kinds")
    base = model_factory("llama")
    experts = {d: perturbed_copy(base, root / d, scale=0.05, seed=10 + i)
               for i, d in enumerate(ALPHABETS)}
    for i, (d, alphabet) in enumerate(ALPHABETS.items()):
        (root / f"{d}.txt").write_text(planted_text(alphabet, seed=i))
    return root, base, experts


CALIBRATION = ("calibration: {{data: [letters={root}/letters.txt, digits={root}/digits.txt], "
               "max_tokens: 1024, seq_len: 32}}")


def built(sources, name: str, settings: list[str], *, calibrated: bool):
    """The 2-expert MoE (letters, digits) of these settings, built once per module."""
    root, base, experts = sources
    two = root / f"{name}-two"
    if not two.exists():
        lines = ["kind: moe", f"base_model: {base}", "experts:",
                 *(f"  - {{model: {experts[d]}, name: {d}}}" for d in ("letters", "digits")),
                 *settings, *([CALIBRATION.format(root=root)] if calibrated else [])]
        build_noting(write_recipe(root / f"{name}.yaml", "\n".join(lines) + "\n"), two,
                     progress=False)
    return two


SEQ_CALIBRATED = ["assembly: seq_routed", "per_expert: [embed, lm_head]",
                  "router: {kind: learned, init: calibrate}"]
SEQ_PERPLEXITY = ["assembly: seq_routed", "router: {kind: perplexity}"]
MERGED_DYNAMIC = ["assembly: merged_experts", "segment_length: 4", "curvature: {kind: none}",
                  "mask: {kind: ties}", "dynamic: true"]


def grow(sources, name: str, settings: list[str], *options: str, calibrated: bool):
    """Build the 2-expert MoE, extend it by `marks` (CLI), rebuild the recipe copy:
    (two, three, rebuilt)."""
    root, _, experts = sources
    two = built(sources, name, settings, calibrated=calibrated)
    three, rebuilt = root / f"{name}-three", root / f"{name}-rebuilt"
    text = ["--calibration", f"marks={root}/marks.txt"] if calibrated else []
    start = time.perf_counter()
    done = CliRunner().invoke(app, ["extend", str(two), str(three), "--expert",
                                    str(experts["marks"]), "--name", "marks", *text, *options])
    extended = time.perf_counter() - start
    assert done.exit_code == 0, done.output
    start = time.perf_counter()
    build(write_recipe(root / f"{name}-rebuild.yaml", (three / RECIPE_COPY).read_text()),
          rebuilt, progress=False)
    print(f"{name}: extend {extended:.2f} s, rebuild {time.perf_counter() - start:.2f} s")
    return two, three, rebuilt


def compare_with_rebuild(two, three, rebuilt, label: str) -> float:
    """Every tensor but the routers bit for bit, the routers within 1e-6 relative, the same
    config.json; the old model's tensors unchanged (the routers and curvature grow). Returns
    the largest router gap."""
    mine, theirs, old = tensors(three), tensors(rebuilt), tensors(two)
    assert mine.keys() == theirs.keys()
    gaps = []
    for name, tensor in mine.items():
        if name.endswith(ROUTERS) or name.endswith(".mlp.router.weight"):
            gaps.append(relative(tensor, theirs[name]))
        else:
            assert torch.equal(tensor, theirs[name]), name
        if name in old and ".curvature." not in name and not name.endswith("router.weight"):
            assert torch.equal(tensor, old[name]), name
    config = json.loads((three / "config.json").read_text())
    assert config == json.loads((rebuilt / "config.json").read_text())
    assert (three / "modeling_moemerge.py").read_bytes() == \
        (rebuilt / "modeling_moemerge.py").read_bytes()
    print(f"{label}: {len(mine)} tensors equal to the rebuild's; routers max |Δ| relative "
          f"{max(gaps):.1e}")
    assert max(gaps) <= 1e-6
    return max(gaps)


def forced_to(expert: int, count: int):
    """Patch a seq_routed model to route every sequence to `expert` alone (weight 1)."""
    def patch(model):
        def route(input_ids, attention_mask=None, run=None):
            weights = torch.zeros(input_ids.shape[0], count)
            weights[:, expert] = 1.0
            return weights, None, {}
        model.route = route
    return patch


def logits(path, patch=None) -> torch.Tensor:
    model = load_pretrained("AutoModelForCausalLM", path, dtype=torch.float32).eval()
    if patch is not None:
        patch(model)
    with torch.no_grad():
        return model(input_ids=IDS).logits


def dense_logits(path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_seq_routed_calibrated_per_expert(sources, tmp_path):
    """A learned router (calibrate) with per-expert embedding and head: nothing is shared, so
    no --keep-shared; --recalibrate calibrates the router on all three texts."""
    two, three, rebuilt = grow(sources, "seq-cal", SEQ_CALIBRATED, "--recalibrate",
                               calibrated=True)
    compare_with_rebuild(two, three, rebuilt, "seq_routed learned/calibrate")
    want = dense_logits(sources[2]["marks"])
    got = logits(three, forced_to(2, 3))
    gap = float((got - want).abs().max())
    print(f"seq_routed forced to the new expert: max |Δlogit| against its dense model {gap:.1e}")
    assert gap <= 1e-5
    assert (logits(three, forced_to(1, 3)) - want).abs().max() > 1e-3  # the check can fail
    assert generate_in_fresh_process(three, tmp_path) == ["8", "seq_routed"]


def with_tensors_of(expert, moe: dict, rename: dict, dst):
    """A plain dense copy of `expert` whose tensors named in `rename` (its name -> the MoE's)
    are the MoE's."""
    perturbed_copy(expert, dst, scale=0.0, seed=0)
    dense = load_file(dst / "model.safetensors")
    for name, theirs in rename.items():
        dense[name] = moe[theirs]
    save_file(dense, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("router", ["perplexity", "task_vector"])
def test_seq_routed_training_free_routers_keep_the_shared_tensors(sources, router, tmp_path):
    """The embedding and head merged by average across the experts: --keep-shared keeps them
    (the new expert joins the recipe copy with weight 0); the router tensor is the random draw
    a rebuild makes; task_vector keeps the base (`base.*`) and stores nothing per expert.
    Forced to the new expert, the MoE is the new expert's stack between the shared embedding
    and head (a dense Llama written here)."""
    two, three, rebuilt = grow(sources, f"seq-{router}", [
        "assembly: seq_routed", f"router: {{kind: {router}}}"], "--keep-shared",
        calibrated=False)
    compare_with_rebuild(two, three, rebuilt, f"seq_routed {router}")
    mine = tensors(three)
    assert ("base.model.norm.weight" in mine) == (router == "task_vector")
    reference = with_tensors_of(sources[2]["marks"], mine, {
        "model.embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "lm_head.weight"},
        tmp_path / "reference")
    want = dense_logits(reference)
    gap = float((logits(three, forced_to(2, 3)) - want).abs().max())
    print(f"seq_routed {router} forced to the new expert: max |Δlogit| {gap:.1e}")
    assert gap <= 1e-5
    assert (logits(three, forced_to(0, 3)) - want).abs().max() > 1e-3
    model = load_pretrained("AutoModelForCausalLM", three, dtype=torch.float32).eval()
    with torch.no_grad():  # the router itself runs over all three experts
        assert model(input_ids=IDS).routing_weights.shape == (2, 3)


def merged_forced(expert: int, count: int):
    fixed = torch.zeros(count)
    fixed[expert] = 1.0

    def patch(model):
        for mlp in model.mlps():
            mlp.scores = lambda h: fixed.expand(*h.shape[:2], count)
    return patch


def test_merged_experts_calibrated_camex(sources, tmp_path):
    """Kronecker curvature (the new slots at the identity, as build writes every expert's),
    calibrated routers (--recalibrate), backbone merged by average (--keep-shared). With α 1,
    no mask and M = I, the MoE at scores one-hot(new) is the new expert's FFN on the MoE's
    backbone: a dense Llama written here from the new expert's FFN and the backbone."""
    two, three, rebuilt = grow(sources, "merged-cal", [
        "assembly: merged_experts", "segment_length: 4",
        "curvature: {kind: kronecker, rank: 2}", "router: {init: calibrate}"],
        "--keep-shared", "--recalibrate", calibrated=True)
    compare_with_rebuild(two, three, rebuilt, "merged_experts CAMEx calibrate")
    mine = tensors(three)
    new_slot = mine["model.layers.1.mlp.curvature.down_proj.A"][2]
    assert torch.equal(new_slot, torch.eye(new_slot.shape[-1]).expand_as(new_slot))
    marks = sources[2]["marks"]
    backbone = [n for n in load_file(marks / "model.safetensors") if ".mlp." not in n]
    want = dense_logits(with_tensors_of(marks, mine, {n: n for n in backbone},
                                        tmp_path / "reference"))
    gap = float((logits(three, merged_forced(2, 3)) - want).abs().max())
    print(f"merged_experts at scores one-hot(new): max |Δlogit| against the plain reference "
          f"{gap:.1e}")
    assert gap <= 1e-5
    assert (logits(three, merged_forced(1, 3)) - want).abs().max() > 1e-3
    assert generate_in_fresh_process(three, tmp_path) == ["8", "moemerge_merged"]


def test_merged_experts_dynamic_ties_random_router(sources):
    """SMEAR-style (no curvature), TIES-CA mask, dynamic E_m, random routers (not calibrated:
    the grown routers are a rebuild's random draw)."""
    two, three, rebuilt = grow(sources, "merged-dyn", MERGED_DYNAMIC, "--keep-shared",
                               calibrated=False)
    compare_with_rebuild(two, three, rebuilt, "merged_experts dynamic TIES random")


def test_refusals_say_what_to_do(sources, model_factory, tmp_path):
    root, _, experts = sources
    calibrated = built(sources, "seq-cal", SEQ_CALIBRATED, calibrated=True)
    free = built(sources, "seq-perplexity", SEQ_PERPLEXITY, calibrated=False)
    marks = ["--expert", str(experts["marks"]), "--name", "marks"]
    text = ["--calibration", f"marks={root}/marks.txt"]

    def run(moe, *extra):
        done = CliRunner().invoke(app, ["extend", str(moe), str(tmp_path / "out"), *extra])
        return done.exit_code, " ".join(done.output.split())

    code, out = run(calibrated, *marks, *text)  # no statistics for a sequence router
    assert code == 1 and "--recalibrate" in out and "no router statistics" in out, out
    code, out = run(free, *marks, *text, "--keep-shared")
    assert code == 2 and "not calibrated" in out, out
    for other in (model_factory("llama", hidden=48), model_factory("llama", layers=3)):
        code, out = run(free, "--expert", str(other), "--keep-shared")
        assert code == 1 and "same base" in out, out
    code, out = run(experts["marks"], *marks)  # a dense model
    assert code == 1 and "is a dense model; `moemerge extend` takes only token_routed, " \
        "seq_routed and merged_experts models" in out, out
    bare = perturbed_copy(free, tmp_path / "bare", scale=0.0, seed=0)
    (bare / RECIPE_COPY).unlink()
    code, out = run(bare, *marks, "--keep-shared")
    assert code == 1 and "not a model `moemerge build` made" in out, out
    trained = perturbed_copy(free, tmp_path / "trained", scale=0.0, seed=0)
    (trained / "training").mkdir()
    code, out = run(trained, *marks, "--keep-shared")
    assert code == 1 and "extend the model `build` wrote" in out, out
    exported = perturbed_copy(built(sources, "merged-dyn", MERGED_DYNAMIC, calibrated=False),
                              tmp_path / "exported", scale=0.0, seed=0)
    config = json.loads((exported / "config.json").read_text())
    (exported / "config.json").write_text(json.dumps(dict(config, mask="none")))
    code, out = run(exported, *marks, "--keep-shared")
    assert code == 2 and "changed since `moemerge build` wrote it" in out, out
    bridged = tmp_path / "bridged"
    build(write_recipe(tmp_path / "bridged.yaml", "kind: moe\nassembly: bridged\nexperts: "
                       f"[{experts['letters']}, {experts['digits']}]\n"), bridged,
          progress=False, verify="structure")
    code, out = run(bridged, *marks)
    assert code == 1 and "bridged" in out, out
    assert not (tmp_path / "out").exists()
