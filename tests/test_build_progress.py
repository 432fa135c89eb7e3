"""build's progress: every stage on stderr as it runs, with what it found and its time;
nothing at all with progress off (-q), so scripts read only results."""

import re

from conftest import perturbed_copy, write_recipe

from moemerge.api import build


def merge_recipe(tmp_path, model_factory):
    base = model_factory("llama")
    expert = perturbed_copy(base, tmp_path / "e", scale=0.1, seed=1)
    return write_recipe(tmp_path / "r.yaml", f"kind: moe\nassembly: token_routed\n"
                        f"base_model: {base}\nexperts: [{expert}, {expert}]\n"
                        "router: {init: random}\n")


def test_each_stage_is_said_as_it_ends(model_factory, tmp_path, capsys):
    result = build(merge_recipe(tmp_path, model_factory), tmp_path / "out", progress=True)
    said = capsys.readouterr()
    assert said.out == ""  # progress is on stderr only
    lines = said.err.splitlines()
    planned = f"3 models, {len(result.plan.jobs)} output tensors"
    assert re.fullmatch(rf"✓ planning: {planned}, "
                        r"[\d.]+ (KiB|MiB) \(\d+\.\d s\)", lines[0]), lines
    assert any(line.startswith("merging") and f"{len(result.plan.jobs)}/" in line
               for line in lines), lines
    assert re.fullmatch(r"✓ checking that the output loads in transformers \(\d+\.\d s\)",
                        lines[-1]), lines


def test_nothing_is_said_without_progress(model_factory, tmp_path, capsys):
    build(merge_recipe(tmp_path, model_factory), tmp_path / "out", progress=False)
    assert capsys.readouterr() == ("", "")
