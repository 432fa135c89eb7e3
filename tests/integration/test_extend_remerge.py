"""`moemerge extend` where the shared (non-FFN) tensors depend on the expert set: without
--keep-shared they are merged again with the new experts, as `moemerge build` of the output's
recipe copy merges them, and the routers are calibrated again on all the text. The oracle is a
from-scratch build of OUT's recipe copy: every tensor equal bit for bit, routers included; the
--keep-shared output differs from it in the shared tensors. And the same-base check: a model of
another initialisation is refused, the perturbed experts pass. Three distinct experts with every
tensor perturbed (test_extend_assemblies.py's), planted domains (test_extend.py's)."""

import shutil
import time

import pytest
import torch
from conftest import build_noting, perturbed_copy, write_recipe
from safetensors import safe_open
from test_extend import ALPHABETS, planted_text, tensors
from test_extend_assemblies import MERGED_DYNAMIC, built
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.io.atomic import RECIPE_COPY
from moemerge.routing.statistics import STATS_FILE

TOKEN_AVERAGE = ["experts_per_token: 1"]
TOKEN_TIES = ["experts_per_token: 1", "merge: {method: ties, density: 0.5, lambda: 0.8}"]
SEQ_SHARED = ["assembly: seq_routed", "router: {kind: learned, init: calibrate}"]


@pytest.fixture(scope="module")
def sources(model_factory, tmp_path_factory):
    """(root, base, {domain: expert}): every tensor perturbed, planted texts."""
    root = tmp_path_factory.mktemp("extend-remerge")
    base = model_factory("llama")
    experts = {d: perturbed_copy(base, root / d, scale=0.05, seed=20 + i)
               for i, d in enumerate(ALPHABETS)}
    for i, (d, alphabet) in enumerate(ALPHABETS.items()):
        (root / f"{d}.txt").write_text(planted_text(alphabet, seed=i))
    return root, base, experts


def extend(sources, moe, out, *options, calibrated: bool = True, expert=None):
    root, _, experts = sources
    text = ["--calibration", f"marks={root}/marks.txt"] if calibrated else []
    done = CliRunner().invoke(app, ["extend", str(moe), str(out), "--expert",
                                    str(expert or experts["marks"]), "--name", "marks", *text,
                                    *options])
    return done.exit_code, " ".join(done.output.split())


def backbone(name: str) -> bool:
    """A shared tensor outside the experts' FFNs and the routers (every kind's names)."""
    return (".mlp." not in name and "block_sparse_moe" not in name
            and not name.startswith("experts.") and not name.endswith("router.weight"))


def remerged_against_rebuild(sources, name: str, settings: list[str], *, calibrated: bool,
                             routers: tuple[str, ...], keep: tuple[str, ...] = (),
                             is_shared=backbone):
    """Extend by `marks` with neither flag, rebuild OUT's recipe copy, extend again with
    --keep-shared: every tensor of OUT is the rebuild's (torch.equal, routers included); the
    shared tensors differ from the --keep-shared output's. Returns (OUT, the note printed)."""
    root = sources[0]
    two = built(sources, name, settings, calibrated=calibrated)
    three, rebuilt, kept = (root / f"{name}-{s}" for s in ("three", "rebuilt", "kept"))
    start = time.perf_counter()
    code, out = extend(sources, two, three, calibrated=calibrated)
    extended = time.perf_counter() - start
    assert code == 0, out
    start = time.perf_counter()
    build_noting(write_recipe(root / f"{name}-rebuild.yaml", (three / RECIPE_COPY).read_text()),
                 rebuilt, progress=False)
    rebuilding = time.perf_counter() - start
    mine, theirs = tensors(three), tensors(rebuilt)
    assert mine.keys() == theirs.keys()
    unequal = [n for n, t in mine.items() if not torch.equal(t, theirs[n])]
    assert not unequal, unequal
    assert any(n.endswith(routers) for n in mine)
    code, keep_out = extend(sources, two, kept, "--keep-shared", *keep, calibrated=calibrated)
    assert code == 0 and "note:" not in keep_out, keep_out
    kept_tensors = tensors(kept)
    shared = [n for n in kept_tensors if is_shared(n)]
    assert shared
    same = [n for n in shared if torch.equal(kept_tensors[n], mine[n])]
    assert not same, same  # every shared tensor re-merged (each expert perturbed everywhere)
    print(f"{name}: {len(mine)} tensors equal to the rebuild's bit for bit, routers included; "
          f"{len(shared)} shared tensors differ from --keep-shared's; extend {extended:.2f} s, "
          f"rebuild {rebuilding:.2f} s")
    return three, out


@pytest.mark.parametrize("name,settings", [("tok-average", TOKEN_AVERAGE),
                                           ("tok-ties", TOKEN_TIES)])
def test_token_routed_remerge_is_the_rebuild(sources, name, settings):
    three, note = remerged_against_rebuild(sources, name, settings, calibrated=True,
                                           routers=("gate.weight",))
    method = "ties" if "ties" in name else "average"
    assert f"note: the shared tensors depend on the expert set (merge method {method})" in note
    assert "calibrated again on all the calibration text" in note, note
    with safe_open(str(three / STATS_FILE), framework="pt") as a, \
            safe_open(str(three.with_name(f"{name}-rebuilt") / STATS_FILE),
                      framework="pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    assert "merged again with the new experts" in (three / "README.md").read_text()


def test_seq_routed_calibrated_shared_embedding_remerge_is_the_rebuild(sources):
    """The merged embedding and head are merged again; the learned router, calibrated, is
    calibrated again on all the text with no --recalibrate (the re-merge implies it)."""
    _, note = remerged_against_rebuild(sources, "seq-shared", SEQ_SHARED, calibrated=True,
                                       routers=("router.weight",), keep=("--recalibrate",))
    assert "2 re-merged" in note and "calibrated again" in note, note


def test_merged_experts_random_router_remerge_is_the_rebuild(sources):
    """The backbone merged again; the random routers are a rebuild's draw, not calibrated."""
    _, note = remerged_against_rebuild(sources, "merged-dyn", MERGED_DYNAMIC, calibrated=False,
                                       routers=(".mlp.router.weight",))
    assert "re-merged" in note and "calibrated again" not in note, note


def test_a_missing_input_of_the_remerge_is_named(sources, tmp_path):
    """The re-merge reads the old experts where the recipe copy names them: one that is gone is
    named, with --keep-shared as the way around; so is an old calibration text that is gone."""
    root, _, experts = sources
    moved = shutil.copytree(built(sources, "tok-average", TOKEN_AVERAGE, calibrated=True),
                            tmp_path / "two")
    copy = moved / RECIPE_COPY
    gone = tmp_path / "gone" / "digits"
    recipe = copy.read_text()
    copy.write_text(recipe.replace(f"model: {experts['digits']},", f"model: {gone},"))
    code, out = extend(sources, moved, tmp_path / "out")
    assert code == 1 and str(gone) in out and "--keep-shared" in out, out
    print(out)
    assert not (tmp_path / "out").exists()
    code, out = extend(sources, moved, tmp_path / "out", "--keep-shared")
    assert code == 0, out
    copy.write_text(recipe.replace(f"{root}/digits.txt", f"{gone}.txt"))
    code, out = extend(sources, moved, tmp_path / "out2")
    assert code == 2 and f"{gone}.txt" in out and "--keep-shared" in out, out
    assert not (tmp_path / "out2").exists()


def test_an_expert_of_another_initialisation_is_refused(sources, model_factory, tmp_path):
    """Same family and shapes, another random init: refused with the expert, the tensor and the
    figures, with and without --keep-shared, and before --calibration is asked for (which
    this expert's text would not have mended); with the base gone the check is skipped."""
    other = model_factory("llama", seed=5)
    two = built(sources, "tok-average", TOKEN_AVERAGE, calibrated=True)
    for options, calibrated in (((), True), (("--keep-shared",), True), ((), False)):
        code, out = extend(sources, two, tmp_path / "out", *options, expert=other,
                           calibrated=calibrated)
        assert code == 1 and f"--expert {other}" in out and "same base" in out, out
        assert "'model.embed_tokens.weight'" in out and "cosine" in out, out
        print(out)
    assert not (tmp_path / "out").exists()
    baseless = shutil.copytree(two, tmp_path / "baseless")
    copy = baseless / RECIPE_COPY
    copy.write_text(copy.read_text().replace(f"base_model: {sources[1]}\n",
                                             f"base_model: {tmp_path / 'gone-base'}\n"))
    code, out = extend(sources, baseless, tmp_path / "out", "--keep-shared", expert=other)
    assert code == 0, out  # the base is not at hand: no check, no error


def test_qwen2_moe_average_shared_expert_remerge_is_the_rebuild(model_factory, tmp_path):
    """merge.method: base (the backbone copies the base) with shared_expert: average: only the
    shared expert's FFN depends on the expert set, and only it is merged again."""
    base = model_factory("qwen2")
    experts = {d: perturbed_copy(base, tmp_path / d, scale=0.05, seed=30 + i)
               for i, d in enumerate(ALPHABETS)}
    for i, (d, alphabet) in enumerate(ALPHABETS.items()):
        (tmp_path / f"{d}.txt").write_text(planted_text(alphabet, seed=i))
    three, note = remerged_against_rebuild(
        (tmp_path, base, experts), "qwen-shared",
        ["experts_per_token: 1", "shared_expert: average", "merge: {method: base}"],
        calibrated=True, routers=("mlp.gate.weight",),
        is_shared=lambda n: ".shared_expert." in n)
    assert "(shared_expert: average): 6 re-merged" in note, note
    kept = tensors(three.with_name("qwen-shared-kept"))
    embed = "model.embed_tokens.weight"  # merge.method: base: the backbone stays the base's
    assert torch.equal(kept[embed], tensors(three)[embed])
    recalibrated = tmp_path / "qwen-kept-recalibrated"
    code, out = extend((tmp_path, base, experts), three.with_name("qwen-shared-two"),
                       recalibrated, "--keep-shared", "--recalibrate")
    assert code == 0, out
    rebuilt = tmp_path / "qwen-kept-rebuilt"
    build_noting(write_recipe(tmp_path / "kept.yaml", (recalibrated / RECIPE_COPY).read_text()),
                 rebuilt, progress=False)
    mine, theirs = tensors(recalibrated), tensors(rebuilt)
    # the calibration text is cut by the base's tokenizer, as build cuts it (MOE's copy of it
    # loads as another class under qwen2_moe): the routers are the rebuild's too
    assert [n for n, t in mine.items() if not torch.equal(t, theirs[n])] == []
