"""What `moemerge build` says when it is done, and what the model card's front matter lists:
the output check by what it loaded, how to load an output that runs moemerge's modeling code,
and hub ids only under `base_model:`."""

import re

import yaml
from conftest import perturbed_copy, write_recipe
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.finish.card import model_card
from moemerge.plan.jobs import Plan
from moemerge.recipe.load import parse_recipe


def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


def test_a_seq_routed_build_says_to_trust_its_remote_code(model_factory, tmp_path):
    base = model_factory("llama")
    expert = perturbed_copy(base, tmp_path / "e", scale=0.05, seed=1, only="mlp")
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: moe\nassembly: seq_routed\n"
                          f"base_model: {base}\nexperts: [{base}, {expert}]\n")
    out = tmp_path / "seq"
    done = CliRunner().invoke(app, ["build", str(recipe), str(out), "-q"])
    assert done.exit_code == 0, done.output
    said = " ".join(done.stdout.split())
    assert "output check: loaded in transformers as MoemergeForCausalLM, logits finite" in said
    assert (f"load it with AutoModelForCausalLM.from_pretrained('{out}', "
            "trust_remote_code=True)") in said, said
    card = (out / "README.md").read_text()
    assert "`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`" in card
    assert "base_model" not in front_matter(card)  # local directories: nothing on the hub
    assert f"`{expert}`" in card  # named in the card's own text


def test_a_token_routed_build_says_what_loaded_and_needs_no_remote_code(tiny_moe, tmp_path):
    done = CliRunner().invoke(app, ["build", str(tiny_moe / "moemerge_recipe.yaml"),
                                    str(tmp_path / "again"), "-q"])
    assert done.exit_code == 0, done.output
    said = " ".join(done.stdout.split())
    assert re.search(r"built \S+ \(\d+ tensors, [\d.]+ MiB; output check: loaded in "
                     r"transformers as MixtralForCausalLM, logits finite\)", said), said
    assert "trust_remote_code" not in said
    assert "trust_remote_code" not in (tmp_path / "again" / "README.md").read_text()


def test_the_cards_base_model_lists_hub_ids_only(tmp_path):
    local = tmp_path / "my-expert"
    local.mkdir()
    recipe = parse_recipe({"kind": "moe", "base_model": "org/base",
                           "experts": ["org/expert-a", str(local)]}, "r.yaml")
    card = model_card(recipe, Plan([], [], {"architectures": ["MixtralForCausalLM"]}), "",
                      tmp_path)
    assert front_matter(card)["base_model"] == ["org/base", "org/expert-a"]
    assert f"`{local}`" in card
    assert "1 expert," not in card and "2 experts, 2 per token" in card
