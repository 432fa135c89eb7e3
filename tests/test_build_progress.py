"""build's progress: every stage on stderr as it runs, with what it found and its time; off a
terminal (a pipe, a log, here pytest's capture) as plain lines, since nothing redraws there;
nothing at all with progress off (-q), so scripts read only results."""

import re

from conftest import perturbed_copy, write_recipe
from typer.testing import CliRunner

from moemerge import progress
from moemerge.api import build
from moemerge.cli import app
from moemerge.progress import Stages, step_lines


def merge_recipe(tmp_path, model_factory):
    base = model_factory("llama")
    expert = perturbed_copy(base, tmp_path / "e", scale=0.1, seed=1)
    return write_recipe(tmp_path / "r.yaml", f"kind: moe\nassembly: token_routed\n"
                        f"base_model: {base}\nexperts: [{expert}, {expert}]\n"
                        "router: {init: random}\n")


def test_each_stage_is_said_as_it_starts_and_ends(model_factory, tmp_path, capsys):
    result = build(merge_recipe(tmp_path, model_factory), tmp_path / "out", progress=True)
    said = capsys.readouterr()
    assert said.out == ""  # progress is on stderr only
    lines = said.err.splitlines()
    jobs = len(result.plan.jobs)
    assert lines[0] == "planning…", lines
    assert re.fullmatch(rf"✓ planning: 3 models, {jobs} output tensors, "
                        r"[\d.]+ (KiB|MiB) \(\d+\.\d s\)", lines[1]), lines
    assert any(re.fullmatch(rf"✓ merging: {jobs}/{jobs} tensors, [\d.]+ MiB \(\d+\.\d s\)", line)
               for line in lines), lines
    # the load check says what it loaded and ran, not a bare "(0.0 s)"
    assert lines[-2] == "checking the output…", lines
    assert re.fullmatch(r"✓ checking the output: loaded in transformers as MixtralForCausalLM, "
                        r"logits finite \(\d+\.\d s\)", lines[-1]), lines
    assert result.loaded == "loaded in transformers as MixtralForCausalLM, logits finite"


def test_nothing_is_said_without_progress(model_factory, tmp_path, capsys):
    build(merge_recipe(tmp_path, model_factory), tmp_path / "out", progress=False)
    assert capsys.readouterr() == ("", "")


def test_off_a_terminal_a_loop_says_how_far_it_is(monkeypatch, capsys):
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)  # a line after every item
    items = list(Stages(True).bar("merging", iter(range(3)), 3 * 2**20, 3, lambda _: 2**20))
    assert items == [0, 1, 2]
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "merging: 3 tensors, 3.0 MiB…"
    assert [line.split(" (")[0] for line in lines[1:4]] == [
        f"merging: {i}/3 tensors, {i}.0 MiB of 3.0 MiB" for i in (1, 2, 3)]
    assert re.fullmatch(r"✓ merging: 3/3 tensors, 3.0 MiB \(\d+\.\d s\)", lines[4]), lines


def test_off_a_terminal_training_says_each_phase(monkeypatch):
    """The toy experts' training (`moemerge demo`, minutes the first time): a line as each
    model starts, now and then, and as it ends."""
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    said: list[str] = []
    on_step = step_lines(said.append, "training base", 3)
    for step, loss in enumerate([3.0, 2.5, 2.0]):
        on_step(step, loss)
    assert said[0] == "training base: 3 steps…"
    assert [line.split(" (")[0] for line in said[1:3]] == [
        "training base: step 1/3, loss 3.000", "training base: step 2/3, loss 2.500"]
    assert re.fullmatch(r"✓ training base: 3 steps, loss 2\.000 \(\d+\.\d s\)", said[3]), said


def test_the_toy_experts_progress_is_lines_in_a_pipe(capsys):
    from moemerge.toy.experts import progress_bars

    with progress_bars(True) as task:
        on_step = task("code", 2)
        on_step(0, 1.5)
        on_step(1, 1.25)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "training code: 2 steps…"
    assert lines[-1].startswith("✓ training code: 2 steps, loss 1.250 ("), lines


def test_the_cli_says_its_stages_in_a_pipe_and_nothing_with_quiet(model_factory, tmp_path):
    recipe = merge_recipe(tmp_path, model_factory)
    said = CliRunner().invoke(app, ["build", str(recipe), "--dry-run"])
    assert said.exit_code == 0, said.output
    assert "loading torch and transformers…" in said.stderr
    assert re.search(r"✓ planning: 3 models, \d+ output tensors", said.stderr), said.stderr
    quiet = CliRunner().invoke(app, ["build", str(recipe), "--dry-run", "-q"])
    assert quiet.exit_code == 0, quiet.output
    assert "planning" not in quiet.stderr and "loading" not in quiet.stderr, quiet.stderr
