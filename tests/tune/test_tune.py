"""`build --tune-on`: the search picks the known best, the recipe copy reproduces the build."""

import pytest
from conftest import TEXT, perturbed_copy, write_recipe
from typer.testing import CliRunner

from moemerge.api import RECIPE_COPY, build
from moemerge.cli import app
from moemerge.eval.perplexity import perplexity
from moemerge.loading import load_causal_lm
from moemerge.tune import TUNING_FILE, TuneOptions

runner = CliRunner()
# 8 windows of 32 + 1 tokens: one forward per candidate
GRID = dict(lambdas=(0.3, 0.6, 1.0), densities=(0.5, 0.9), max_tokens=264, seq_len=32)


@pytest.fixture
def held_out(tmp_path):
    return write_recipe(tmp_path / "held_out.txt", TEXT * 12)


def recipe(tmp_path, base, experts, merge, kind="merge"):
    models = "models" if kind == "merge" else "experts"
    return write_recipe(tmp_path / "recipe.yaml", f"kind: {kind}\nbase_model: {base}\n"
                        f"{models}: [{', '.join(map(str, experts))}]\nmerge: {merge}\n")


def test_noise_on_one_role_gets_the_smallest_lambda(model_factory, tmp_path, held_out):
    # the experts differ from the base only by large noise on lm_head: the less of it, the better;
    # every other role has zero task vectors: no value changes it, so none is scored
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=1.0, seed=i, only="lm_head")
               for i in range(2)]
    path = recipe(tmp_path, base, experts, "{method: task_arithmetic, lambda: 1.0}")
    opts = TuneOptions(held_out, **GRID)
    result = build(path, tmp_path / "out", progress=False, tune=opts).tuning
    assert result.chosen == {"lm_head": (0.3, None)}
    assert result.tuned < result.baseline
    assert {c.role for c in result.candidates} == {"recipe", "lm_head"}
    assert result.unchanged == ("embed", "attn", "norm", "ffn")
    assert len(result.candidates) == 1 + len(GRID["lambdas"])  # task arithmetic: no density
    model, tok = load_causal_lm(tmp_path / "out")  # the built model is the one that was scored
    assert perplexity(model, tok, held_out.read_text(), seq_len=32, max_tokens=264) == (
        pytest.approx(result.tuned, rel=1e-6))
    untuned = tmp_path / "untuned"
    build(path, untuned, progress=False)
    model, tok = load_causal_lm(untuned)
    assert perplexity(model, tok, held_out.read_text(), seq_len=32, max_tokens=264) == (
        pytest.approx(result.baseline, rel=1e-6))


@pytest.mark.parametrize("kind, merge", [("merge", "{method: dare_ties, lambda: 1.0}"),
                                         ("moe", "{method: ties, density: 0.7}"),
                                         ("merge", "{method: della, epsilon: 0.1}")])
def test_recipe_copy_reproduces_the_build(kind, merge, model_factory, tmp_path, held_out):
    base = model_factory("qwen2")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.3, seed=i) for i in range(2)]
    path = recipe(tmp_path, base, experts, merge, kind)
    out = tmp_path / "out"
    opts = TuneOptions(held_out, **{**GRID, "lambdas": (0.5, 1.0)})
    result = build(path, out, progress=False, tune=opts).tuning
    assert result.tuned <= result.baseline and len(result.candidates) > 1
    assert "overrides" in (out / RECIPE_COPY).read_text() and result.chosen
    again = tmp_path / "again"
    build(out / RECIPE_COPY, again, progress=False)
    files = sorted(p.name for p in out.iterdir() if p.name != TUNING_FILE)
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name


def run(*args):
    result = runner.invoke(app, ["build", *map(str, args)])
    return result.exit_code, result.output


def test_bad_input_fails_before_any_work(model_factory, tmp_path, held_out):
    base = model_factory("llama")
    ties = recipe(tmp_path, base, [base, base], "{method: ties}")
    out = tmp_path / "out"
    cases = [
        ((tmp_path / "missing.txt",), "missing.txt: no such file or directory"),
        ((write_recipe(tmp_path / "empty.txt", " \n"),), "empty.txt: empty file"),
        ((write_recipe(tmp_path / "short.txt", "def add"),), "fewer than one window"),
        ((held_out, "--tune-lambdas", "0.5,x"), "comma-separated numbers"),
        ((held_out, "--tune-densities", "0,0.5"), "must be in (0, 1]"),
    ]
    for args, message in cases:
        code, text = run(ties, out, "--tune-on", *args)
        assert code == 2 and message in text, (args, text)
    code, text = run(recipe(tmp_path, base, [base, base], "{method: average}"), out,
                     "--tune-on", held_out)
    assert code == 2 and "nothing to tune" in text
    code, text = run(ties, out, "--tune-on", held_out, "--dry-run")
    assert code == 2 and "dry run" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "empty.txt", "held_out.txt", "recipe.yaml", "short.txt"]
    out.mkdir()
    code, text = run(ties, out, "--tune-on", held_out)
    assert code == 1 and "already exists" in text


def test_several_domains_weigh_the_same(model_factory, tmp_path):
    """A directory of domains: the score is the geometric mean of each domain's perplexity on
    its own max_tokens / N tokens, not the first max_tokens of the texts joined (which would be
    the long first domain alone); a domain too short for one window is named."""
    import math

    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.3, seed=i) for i in range(2)]
    texts = {"a_long": TEXT * 40, "b_short": "x = [i * i for i in range(10)]\n" * 30}
    held = tmp_path / "held"
    held.mkdir()
    for name, text in texts.items():
        (held / f"{name}.txt").write_text(text)
    path = recipe(tmp_path, base, experts, "{method: task_arithmetic, lambda: 1.0}")
    untuned = tmp_path / "untuned"
    build(path, untuned, progress=False)
    model, tok = load_causal_lm(untuned)
    each = [perplexity(model, tok, t, seq_len=32, max_tokens=132) for t in texts.values()]
    joined = perplexity(model, tok, "\n\n".join(texts.values()), seq_len=32, max_tokens=264)
    result = build(path, tmp_path / "out", progress=False,
                   tune=TuneOptions(held, **{**GRID, "lambdas": (1.0,)})).tuning
    assert result.baseline == pytest.approx(math.sqrt(each[0] * each[1]), rel=1e-6)
    assert abs(result.baseline - joined) > 1e-3 * joined  # the comparison can fail
    (held / "c_tiny.txt").write_text("def add")
    code, text = run(path, tmp_path / "out2", "--tune-on", held, "--tune-seq-len", "32")
    text = " ".join(text.split())
    assert code == 2 and "(c_tiny) has" in text and "fewer than one window" in text, text


def test_the_progress_line_and_the_budget(model_factory, tmp_path, held_out):
    """Each candidate reports how many of the grid are done, the best so far and the time
    left; a budget too small for the grid stops the search after the baseline and one more
    candidate at most, the roles not reached keeping the recipe's values, and says so in
    the table's title and the tuning file."""
    import json

    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.1, seed=i) for i in range(2)]
    path = recipe(tmp_path, base, experts, "{method: task_arithmetic, lambda: 1.0}")
    seen = []
    full = build(path, tmp_path / "full", progress=False, tune=TuneOptions(held_out, **GRID),
                 on_candidate=lambda c, p: seen.append(p)).tuning
    assert [p.done for p in seen] == list(range(1, len(full.candidates) + 1))
    assert {p.total for p in seen} == {len(full.candidates)} == {16}  # 1 + 5 roles x 3 lambdas
    assert seen[-1].seconds_left == 0 and seen[0].seconds_left > 0
    assert [p.best for p in seen] == sorted((p.best for p in seen), reverse=True)
    short = build(path, tmp_path / "short", progress=False,
                  tune=TuneOptions(held_out, **GRID, budget=1e-3)).tuning
    assert len(short.candidates) == 1 and short.chosen == {}
    assert short.stopped == "--tune-budget 0.001 s: stopped after 1 of 16 candidates"
    saved = json.loads((tmp_path / "short" / TUNING_FILE).read_text())
    assert saved["stopped"] == short.stopped
    code = runner.invoke(app, ["build", str(path), str(tmp_path / "cli"), "--tune-on",
                               str(held_out), "--tune-max-tokens", "264", "--tune-seq-len",
                               "32", "--tune-budget", "0"])
    assert code.exit_code == 2 and "--tune-budget" in code.output
