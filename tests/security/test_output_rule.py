"""Every option that names an output obeys one rule (moemerge.io.outputs): never an input,
never over an existing file without --force, written atomically (a temporary file renamed:
a symlink at the output path is replaced, the file it points to never written).

The options are found by walking the Typer app: each path- or text-valued parameter of every
command is either an output, probed below, or listed as not one; a new parameter that is
neither fails `test_every_path_option_is_classified`."""

import os
import re
import shutil

import pytest
import typer
from conftest import perturbed_copy, snapshot, write_recipe
from typer.testing import CliRunner

from moemerge.cli import app

# (command, parameter) -> "file" or "dir": the outputs, each probed by the tests below
OUTPUTS = {
    ("build", "output"): "dir",
    ("finetune", "output"): "dir",
    ("bake", "output"): "dir",
    ("export", "output"): "dir",  # bake's first name
    ("extract", "output"): "dir",
    ("extend", "output"): "dir",
    ("shrink", "output"): "dir",
    ("toy", "directory"): "dir",
    ("demo", "workdir"): "dir",
    ("import-mergekit", "output"): "file",
    ("inspect task-vectors", "json_path"): "file",
    ("inspect task-vectors", "plot"): "file",
    ("inspect task-vectors", "markdown"): "file",
    ("inspect routing", "json_path"): "file",
    ("inspect routing", "plot"): "file",
    ("route", "json_path"): "file",
}
# path- or text-valued parameters that name no output (inputs, choices, names, numbers as text)
NOT_OUTPUTS = {
    ("build", "recipe"), ("build", "verify"), ("build", "tune_on"), ("build", "tune_lambdas"),
    ("build", "tune_densities"), ("build", "device"), ("build", "llama_cpp"),
    ("build", "gguf"),  # a type (f16, ...): the GGUF goes inside OUTPUT, under its rule
    ("validate", "recipes"), ("toy", "preset"), ("demo", "preset"), ("bake", "model"),
    ("export", "model"),
    ("extract", "model"), ("extract", "expert"), ("extract", "weights"), ("extract", "lora"),
    ("extract", "base"), ("extract", "device"),
    ("extend", "model"), ("extend", "expert"), ("extend", "name"), ("extend", "calibration"),
    ("shrink", "model"), ("shrink", "calibration"), ("shrink", "method"), ("shrink", "saliency"),
    ("shrink", "merge_method"), ("shrink", "text_field"),
    ("finetune", "model"), ("finetune", "config"), ("finetune", "data"), ("finetune", "train"),
    ("finetune", "text_field"), ("finetune", "label_field"), ("finetune", "schedule"),
    ("finetune", "device"), ("finetune", "autocast"), ("import-mergekit", "config"),
    ("methods", "name"), ("route", "model"), ("route", "prompts"), ("route", "router"),
    ("route", "split"), ("route", "text_field"), ("inspect task-vectors", "models"),
    ("inspect task-vectors", "recipe"), ("inspect routing", "model"), ("inspect routing", "data"),
    ("inspect routing", "label_field"), ("inspect routing", "text_field"),
}
WRITES = re.compile(r"\b(write|output|goes|go|put)\b", re.IGNORECASE)


def parameters():
    """(command, parameter name, bare type, help) of every command, subcommands included."""
    found = []

    def walk(command, path):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
            return
        for p in command.params:
            found.append((" ".join(path), p.name, p.bare_type(), p.help or ""))

    walk(typer.main.get_command(app), [])
    return found


def test_every_path_option_is_classified():
    valued = {(c, n): h for c, n, t, h in parameters() if t not in ("bool", "int", "float")}
    assert set(valued) == set(OUTPUTS) | NOT_OUTPUTS, (
        "classify these parameters in OUTPUTS (and probe them) or NOT_OUTPUTS: "
        f"{sorted(set(valued) ^ (set(OUTPUTS) | NOT_OUTPUTS))}")
    says_it_writes = {k for k, h in valued.items() if WRITES.search(h)}
    explained = {("build", "verify"), ("build", "device"), ("build", "gguf")}
    assert says_it_writes - explained <= set(OUTPUTS), says_it_writes - set(OUTPUTS)


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture(scope="module")
def world(model_factory, tiny_moe, tmp_path_factory):
    """Inputs of every command: tiny models, a token-routed and a sequence-routed MoE, text,
    recipes, a mergekit config."""
    root = tmp_path_factory.mktemp("world")
    base = model_factory("llama")
    experts = [perturbed_copy(base, root / f"e{i}", scale=0.02, seed=i, only="mlp")
               for i in range(2)]
    recipe = write_recipe(root / "r.yaml", f"kind: moe\nbase_model: {base}\nexperts: "
                          f"[{experts[0]}, {experts[1]}]\nrouter: {{init: random}}\n")
    seq = write_recipe(root / "seq.yaml", f"kind: moe\nassembly: seq_routed\nbase_model: "
                       f"{base}\nexperts: [{experts[0]}, {experts[1]}]\n"
                       "experts_per_sequence: 1\n")
    assert cli("build", seq, root / "seq", "--verify", "structure", "-q")[0] == 0
    text = root / "code.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    mergekit = write_recipe(root / "mk.yml", f"merge_method: linear\nmodels:\n"
                            f"  - model: {experts[0]}\n    parameters: {{weight: 0.5}}\n"
                            f"  - model: {experts[1]}\n    parameters: {{weight: 0.5}}\n")
    return {"base": base, "experts": experts, "recipe": recipe, "seq": root / "seq",
            "moe": tiny_moe, "text": text, "mergekit": mergekit, "root": root}


def invocation(key, w, target):
    """(argv writing `target` through output `key`, an input file of that command)."""
    command, param = key
    e0, e1 = w["experts"]
    option = {"json_path": "--json", "plot": "--plot", "markdown": "--markdown"}.get(param)
    if command == "build":
        return ["build", w["recipe"], target, "-q"], e0 / "config.json"
    if command == "finetune":
        return (["finetune", w["moe"], target, "--data", w["text"], "-q", "--steps", "1"],
                w["moe"] / "config.json")
    if command in ("bake", "export"):
        return [command, w["moe"], target], w["moe"] / "config.json"
    if command == "extract":
        return ["extract", w["moe"], target, "--expert", "0"], w["moe"] / "config.json"
    if command == "extend":  # the new expert is an input too
        return (["extend", w["moe"], target, "--expert", e1, "--calibration", w["text"],
                 "--keep-shared"], e1 / "config.json")
    if command == "shrink":
        return (["shrink", w["moe"], target, "--experts", "1", "--calibration", w["text"],
                 "--seq-len", "16", "-q"], w["moe"] / "config.json")
    if command == "toy":
        return ["toy", target], None
    if command == "demo":
        return ["demo", "--workdir", target], None
    if command == "import-mergekit":
        return ["import-mergekit", w["mergekit"], "-o", target], e0 / "config.json"
    if command == "inspect task-vectors":
        return (["inspect", "task-vectors", w["base"], e0, e1, "-q", option, target],
                e1 / "config.json")
    if command == "inspect routing":
        return (["inspect", "routing", w["moe"], "--data", f"code={w['text']}", "--seq-len", "16",
                 "--max-tokens", "64", option, target], w["moe"] / "config.json")
    assert command == "route", key
    return ["route", w["seq"], w["text"], "--json", target], w["seq"] / "config.json"


def suffix(key):
    return {"plot": ".png", "markdown": ".md"}.get(key[1], ".json")


@pytest.mark.parametrize("key", sorted(OUTPUTS), ids=lambda k: f"{k[0]}:{k[1]}")
def test_an_output_is_never_an_input(key, world, tmp_path):
    """OUT = an input file (or a link to one, --force): exit 2, the input untouched."""
    argv, an_input = invocation(key, world, "TARGET")
    if an_input is None:
        pytest.skip(f"{key[0]} reads no input a user names (toy's cache: "
                    "test_output_placement.py::test_toy_refuses_the_cache_and_the_working_directory)")
    before = snapshot(world["root"]) | snapshot(an_input.parent)
    link = tmp_path / f"link{suffix(key)}"
    link.symlink_to(an_input)
    inside = an_input.parent / f"new{suffix(key)}"  # a new file inside an input model
    for target, force in ((an_input, []), (an_input, ["--force"]), (link, ["--force"]),
                          (inside, [])):
        code, text = cli(*[target if a == "TARGET" else a for a in argv], *force)
        assert code == 2 and "never writes into or replaces its inputs" in text, (target, text)
    assert snapshot(world["root"]) | snapshot(an_input.parent) == before
    assert not inside.exists() and link.is_symlink()


@pytest.mark.parametrize("key", sorted(OUTPUTS), ids=lambda k: f"{k[0]}:{k[1]}")
def test_an_existing_output_needs_force(key, world, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    existing = tmp_path / f"there{suffix(key)}"
    existing.write_text("keep me")
    argv, _ = invocation(key, world, existing)
    code, text = cli(*argv)
    assert code == 1 and "already exists" in text, text
    assert existing.read_text() == "keep me"


FILE_OUTPUTS = sorted(k for k, kind in OUTPUTS.items() if kind == "file")


@pytest.mark.parametrize("key", FILE_OUTPUTS, ids=lambda k: f"{k[0]}:{k[1]}")
def test_a_file_output_is_renamed_into_place(key, world, tmp_path, monkeypatch):
    """--force over a symlink: the link is replaced by the new file, the file it pointed to is
    left alone, and no temporary file stays behind."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("not an input, still never written through a link")
    target = tmp_path / "out" / f"report{suffix(key)}"
    target.symlink_to(elsewhere)
    argv, _ = invocation(key, world, target)
    code, text = cli(*argv, "--force")
    assert code == 0, text
    assert not target.is_symlink() and target.stat().st_size > 0
    assert elsewhere.read_text() == "not an input, still never written through a link"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [target.name]
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~current_umask())


def current_umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_plot_with_an_unsupported_suffix_is_refused_before_the_report(world, tmp_path):
    for argv in (invocation(("inspect task-vectors", "plot"), world, tmp_path / "p.txt")[0],
                 invocation(("inspect routing", "plot"), world, tmp_path / "p.yaml")[0]):
        code, text = cli(*argv)
        assert code == 2 and "must end in one of" in text and ".png" in text, text
    assert list(tmp_path.iterdir()) == []


def test_the_recipe_and_a_model_the_mergekit_config_names_are_inputs(world, tmp_path):
    """The issue's cases: `inspect --recipe r.yaml --markdown r.yaml` and `import-mergekit -o`
    onto a config.json of a model the mergekit config names."""
    before = snapshot(world["root"])
    code, text = cli("inspect", "task-vectors", "--recipe", world["recipe"], "--markdown",
                     world["recipe"], "--force")
    assert code == 2 and "is the recipe" in text, text
    target = world["experts"][0] / "config.json"
    code, text = cli("import-mergekit", world["mergekit"], "-o", target, "--force")
    assert code == 2 and "is inside a model the config names" in text, text
    assert snapshot(world["root"]) == before


def test_a_killed_writers_temporary_file_is_swept(world, tmp_path):
    """A temporary file a dead process left beside a file output is removed by the next
    write; one of a live process is kept."""
    dead = tmp_path / f".r.yaml.moemerge-tmp-{2**22 + 17}-abcd.yaml"
    live = tmp_path / f".r.yaml.moemerge-tmp-{os.getpid()}-abcd.yaml"
    for p in (dead, live):
        p.write_text("half")
    code, text = cli("import-mergekit", world["mergekit"], "-o", tmp_path / "r.yaml")
    assert code == 0, text
    assert not dead.exists() and live.exists()
    shutil.rmtree(tmp_path)
