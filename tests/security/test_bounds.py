"""Issue 41's hostile counts and lengths: each is refused before any work with a message naming
the bound (moemerge/bounds.py), never a RecursionError, a torch stack dump, a bare IndexError
or a hang; and what was accepted silently (an empty or repeated mergekit token, a symlink loop
in a model directory) is an error naming the field or the file."""

import json
import shutil
import time

import pytest
import yaml
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.bounds import MAX_EXPERTS, MAX_STAGES
from moemerge.cli import app
from moemerge.errors import RecipeError
from moemerge.recipe.load import parse_recipe
from moemerge.recipe.mergekit import convert_documents
from moemerge.recipe.stages import Stage, StagesRecipe


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"traceback: {result.exception!r}\n{result.output[-2000:]}")
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture
def work(model_factory, tmp_path, monkeypatch, train_text):
    shutil.copytree(model_factory("llama"), tmp_path / "base")
    shutil.copy(train_text, tmp_path / "t.txt")
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- graph walks: no recursion on a chain or cycle of stages / documents ----------------------

def merge_of(*models):
    return {"kind": "merge", "merge": {"method": "average"},
            "models": [{"model": m} for m in models]}


def chained(n):
    """Stage/document i reads s{i-1}; listed output first, so that a depth-first walk from the
    first entry goes n deep."""
    return [{**({"name": f"s{i}"} if i < n - 1 else {}),
             "recipe": merge_of("base" if i == 0 else f"s{i - 1}", "base")}
            for i in reversed(range(n))]


def test_a_chain_of_1000_mergekit_documents(work):
    """Was a RecursionError (import-mergekit of a mergekit-multi config)."""
    configs = [{**({"name": s["name"]} if "name" in s else {}), "merge_method": "linear",
                "models": s["recipe"]["models"]} for s in chained(1000)]
    write_recipe(work / "multi.yml", yaml.safe_dump_all(configs))
    code, out = cli("import-mergekit", "multi.yml")
    assert code == 2 and "multi.yml" in out and f"at most {MAX_STAGES} documents" in out, out
    with pytest.raises(RecipeError, match=f"at most {MAX_STAGES} documents"):
        convert_documents(configs, "multi.yml")
    # as many as allowed, chained the deep way round: built last to first
    imported = convert_documents(configs[-MAX_STAGES:], "multi.yml")
    order = parse_recipe(imported.recipe).order()
    assert order == list(reversed(range(MAX_STAGES)))


def test_10k_stages_in_a_cycle():
    """Was a RecursionError; the count is refused before any stage is validated, and the walk
    itself has its own stack (a cycle is named, however long)."""
    cycle = [{"name": f"s{i}", "recipe": merge_of(f"s{(i + 1) % 10_000}", "a")}
             for i in range(10_000)]
    with pytest.raises(RecipeError, match=f"10001 stages; a stages recipe has at most "
                                          f"{MAX_STAGES} stages"):
        parse_recipe({"kind": "stages", "stages": [*cycle, {"recipe": merge_of("s0", "a")}]})
    long = [{"name": f"s{i}", "recipe": merge_of(f"s{(i + 1) % 255}", "a")} for i in range(255)]
    with pytest.raises(RecipeError) as caught:
        parse_recipe({"kind": "stages", "stages": [*long, {"recipe": merge_of("s0", "a")}]})
    assert "a cycle: s0 -> s1 -> s2 -> s3 -> … -> s253 -> s254 -> s0 (255 stages)" in str(
        caught.value)
    # order() walks with its own stack: a chain deeper than Python's recursion limit
    built = StagesRecipe.model_construct(
        kind="stages", stages=[Stage.model_construct(**s) for s in chained(5000)])
    assert built.order() == list(reversed(range(5000)))


def test_a_stages_file_of_10k_stages(work):
    write_recipe(work / "s.yaml", "kind: stages\nstages:\n" + "".join(
        f"  - {{name: s{i}, recipe: {{kind: merge, models: [s{(i + 1) % 10_000}]}}}}\n"
        for i in range(10_000)))
    code, out = cli("validate", "s.yaml")
    assert code == 2 and "s.yaml" in out and ("at most 100,000" in out or "at most 256" in out)


# --- counts refused before any work: experts, YAML size and nodes ----------------------------

def test_a_million_experts_fail_fast(work):
    """Did not finish in minutes (60 s to validate, then a build resolving every entry); now
    refused in well under a second by the file's size, its YAML node count (counted before it
    is parsed) or, through the API, the experts' count (before any entry is validated)."""
    write_recipe(work / "block.yaml", "kind: moe\nbase_model: base\nexperts:\n"
                 + "  - base\n" * 10**6)
    write_recipe(work / "flow.yaml", "kind: moe\nbase_model: base\nexperts: ["
                 + "b," * (10**6 - 1) + "b]\n")  # 2 MB
    for name, words in (("block.yaml", "a recipe or config is at most 4,194,304 bytes"),
                        ("flow.yaml", "more than 100,000 YAML nodes")):
        for argv in (["validate", name], ["build", name, "out"]):
            start = time.perf_counter()
            code, out = cli(*argv)
            took = time.perf_counter() - start
            assert code == 2 and name in out and words in out, out
            assert took < 10, (argv, took)  # ~0.2 s; minutes before
    start = time.perf_counter()
    with pytest.raises(RecipeError, match=f"1,000,000 experts; a recipe lists at most "
                                          f"{MAX_EXPERTS} experts"):
        parse_recipe({"kind": "moe", "base_model": "base", "experts": ["base"] * 10**6})
    assert time.perf_counter() - start < 5
    assert not (work / "out").exists()


@pytest.mark.parametrize("text, words", [
    ("kind: moe\nbase_model: base\nexperts: [" + ", ".join(["base"] * 5000) + "]\n",
     "experts: 5,000 experts; a recipe lists at most 4096 experts"),
    ("kind: merge\nmodels: [" + ", ".join(["base"] * 5000) + "]\n",
     "models: 5,000 models; a recipe lists at most 4096 models"),
    ("kind: moe\nassembly: seq_routed\nbase_model: base\nexperts: [" + ", ".join(["base"] * 5000)
     + "]\n", "experts: 5,000 experts"),
    ("kind: upcycle\nmodel: base\nexperts: 64\ngranularity: 100000\n",
     "6,400,000 routed experts; an MoE has at most 4096 experts"),
    ("kind: moe\nbase_model: base\nexperts: [{model: base, positive_prompts: [a]}, "
     "{model: base, positive_prompts: [b]}]\nrouter: {init: prompts, max_prompt_tokens: "
     f"{2**63}}}\n", "router.max_prompt_tokens"),
    ("kind: merge\nmodels: [base, base]\nmodels: [base]\n", "line 3: the document: the key "
     "'models' is given twice"),
])
def test_recipe_counts_are_bounded(work, text, words):
    write_recipe(work / "r.yaml", text)
    code, out = cli("validate", "r.yaml")
    assert code == 2 and "r.yaml" in out and words in out, out


# --- sequence lengths ------------------------------------------------------------------------

def test_finetune_seq_len(tiny_moe, work):
    """--seq-len 2^63 - 1 was a torch stack dump (view(): Overflow when unpacking long); past
    the model's positions it is refused naming max_position_embeddings."""
    code, out = cli("finetune", tiny_moe, "out", "--data", "t.txt", "-q",
                    "--seq-len", 2**63 - 1)
    assert code == 2 and "seq_len (--seq-len)" in out and "1048576" in out, out
    code, out = cli("finetune", tiny_moe, "out", "--data", "t.txt", "-q", "--seq-len", 4096)
    assert code == 2 and "seq_len (--seq-len): 4,096 tokens" in out and \
        "2,048 positions" in out and "max_position_embeddings" in out, out
    code, out = cli("inspect", "routing", tiny_moe, "--data", "t.txt", "--seq-len", 4096)
    assert code == 2 and "--seq-len: 4,096 tokens" in out and "max_position_embeddings" in out
    # drew 2^63 - 1 block indices one by one: ran for ever
    code, out = cli("finetune", tiny_moe, "out", "--data", "t.txt", "-q", "--seq-len", 16,
                    "--batch-size", 2**63 - 1)
    assert code == 2 and "batch_size (--batch-size)" in out and "65536" in out, out
    assert not (work / "out").exists()


@pytest.mark.parametrize("argv, words", [
    (["inspect", "routing", "m", "--data", "t.txt", "--seq-len", 2**63 - 1], "at most 1,048,576"),
    (["inspect", "routing", "m", "--data", "t.txt", "--max-tokens", 2**63 - 1],
     "at most 1,099,511,627,776"),
    (["route", "m", "t.txt", "--max-tokens", 2**63 - 1],
     "--max-tokens: 9,223,372,036,854,775,807 tokens of a prompt; at most 1,048,576"),
    (["build", "r.yaml", "out", "--tune-on", "t.txt", "--tune-seq-len", 2**63 - 1],
     "--tune-seq-len"),
    (["build", "r.yaml", "out", "--tune-on", "t.txt", "--tune-max-tokens", 2**63 - 1],
     "--tune-max-tokens"),
    (["shrink", "m", "out", "--calibration", "t.txt", "--experts", "1", "--seq-len", 2**63 - 1],
     "calibration.seq_len"),
])
def test_length_options_are_bounded(work, argv, words):
    write_recipe(work / "r.yaml", "kind: merge\nbase_model: base\nmodels: [base, base]\n"
                 "merge: {method: task_arithmetic}\n")
    code, out = cli(*argv)
    assert code == 2 and words in out, out
    assert not (work / "out").exists()


# --- the tokenizer fits the embedding before any forward pass --------------------------------

def with_token_past_the_rows(model, dst):
    """A copy of `model` whose tokenizer gives id 300 for 'return', one past its 300 rows."""
    shutil.copytree(model, dst)
    tokenizer = json.loads((dst / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 300, "content": "return", "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False,
                                      "special": False})
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer))
    return dst


def test_a_tokenizer_past_the_embedding(tiny_moe, work):
    """Was `IndexError: index out of range in self` from torch.embedding during shrink's
    calibration (and inspect, finetune, build's calibration and prompt routers)."""
    with_token_past_the_rows(tiny_moe, work / "moe")
    words = "its tokenizer has 301 tokens (largest id 300), but its embedding has 300 rows"
    for argv in (["shrink", "moe", "out", "--calibration", "t.txt", "--experts", "1",
                  "--seq-len", "16"],
                 ["inspect", "routing", "moe", "--data", "t.txt", "--seq-len", "16"],
                 ["finetune", "moe", "out", "--data", "t.txt", "--seq-len", "16", "-q"]):
        code, out = cli(*argv)
        assert code == 1 and "moe: " in out and words in out, (argv, out)
    for model in ("base", "e0", "e1"):
        with_token_past_the_rows(work / "base", work / f"{model}-bad")
    write_recipe(work / "cal.yaml", "kind: moe\nbase_model: base-bad\nexperts: [e0-bad, e1-bad]\n"
                 "calibration: {data: [t.txt], seq_len: 16}\n")
    code, out = cli("build", "cal.yaml", "out", "-q")
    assert code == 1 and "the tokenizer in" in out and "base-bad has 301 tokens" in out and \
        "the output out has 300 rows (vocab_size)" in out, out
    write_recipe(work / "prompts.yaml", "kind: moe\nbase_model: base-bad\nexperts: [{model: "
                 "e0-bad, positive_prompts: [return a]}, {model: e1-bad, positive_prompts: "
                 "[def f]}]\nrouter: {init: prompts}\n")
    code, out = cli("build", "prompts.yaml", "out", "-q")
    assert code == 1 and "base-bad: its tokenizer has 301 tokens" in out, out
    assert not (work / "out").exists()


# --- accepted silently before ----------------------------------------------------------------

MERGEKIT = "merge_method: linear\nmodels:\n  - model: base\n  - model: base\n"


@pytest.mark.parametrize("tokens, words", [
    ('    "": {source: {kind: zero}}\n', 'tokenizer.tokens: an empty token ("")'),
    ('    "<x>": {source: {kind: zero}}\n    "<x>": {source: base}\n',
     "line 9: tokenizer.tokens: the key '<x>' is given twice"),
    ('    1: {source: {kind: zero}}\n    "1": {source: base}\n',
     "tokenizer.tokens.1: the token is listed twice"),
])
def test_mergekit_tokens_empty_or_twice(work, tokens, words):
    write_recipe(work / "mk.yml", MERGEKIT + "tokenizer:\n  source: union\n  tokens:\n" + tokens)
    code, out = cli("import-mergekit", "mk.yml")
    assert code == 2 and "mk.yml" in out and words in out, out


def test_an_empty_token_in_a_recipe(work):
    write_recipe(work / "r.yaml", 'kind: merge\nmodels: [base, base]\ntokenizer: {tokens: '
                 '{"": {source: zero}}}\n')
    code, out = cli("validate", "r.yaml")
    assert code == 2 and 'tokenizer.tokens: an empty token ("")' in out, out


@pytest.mark.parametrize("link", ["loop", "config.json"])
def test_a_symlink_loop_in_an_expert_directory(tiny_moe, work, link):
    """Was built as if the loop were not there (or config.json were missing)."""
    shutil.copytree(work / "base", work / "expert")
    if link == "config.json":
        (work / "expert" / "config.json").unlink()
    (work / "expert" / link).symlink_to("loop2")
    (work / "expert" / "loop2").symlink_to(link)
    write_recipe(work / "r.yaml", "kind: moe\nbase_model: base\nexperts: [base, expert]\n")
    code, out = cli("build", "r.yaml", "out", "-q")
    assert code == 1 and "is a symlink loop" in out and "expert/" in out, out
    assert not (work / "out").exists()
    shutil.copytree(tiny_moe, work / "moe")
    (work / "moe" / "loop").symlink_to("loop")
    code, out = cli("inspect", "routing", "moe", "--data", "t.txt")
    assert code == 1 and "moe/loop is a symlink loop" in out, out
