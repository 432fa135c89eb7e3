"""`moemerge demo` end to end on the TINY preset: the README's first command, in small."""

import json

from typer.testing import CliRunner

from moemerge.cli import app


def test_demo_builds_the_bundled_recipes_and_prints_perplexities(tmp_path, tiny_toy):
    """On the session's toy experts (tests/conftest.py): the demo finds them cached."""
    workdir = tmp_path / "demo"
    result = CliRunner().invoke(app, ["demo", "--preset", "tiny", "--workdir", str(workdir)])
    assert result.exit_code == 0, result.output
    # off a terminal (here, a pipe's case) each build says its stages as plain lines
    assert result.stderr.count("✓ planning: ") == 3, result.stderr
    assert "✓ checking the output: loaded in transformers as MixtralForCausalLM" in result.stderr
    for row in ("base", "expert:code", "expert:prose", "expert:math", "merge (ties)", "moe (btx)",
                "moe (seq_routed)"):
        assert row in result.output
    # the windows of its perplexities, under the table (inspect --data's default differ)
    assert ("perplexity windows: 65 tokens, stride 65 (non-overlapping; the last 32 of each "
            "scored, the first 32 its prompt), over the first 20000 tokens of each domain: code "
            ) in " ".join(result.output.split())
    config = json.loads((workdir / "moe" / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 3
    assert (workdir / "merged" / "model.safetensors").is_file()
    assert json.loads((workdir / "seq" / "config.json").read_text())["assembly"] == "seq_routed"

    # a second run reuses the cached experts and replaces its own outputs
    again = CliRunner().invoke(app, ["demo", "--preset", "tiny", "--workdir", str(workdir)])
    assert again.exit_code == 0, again.output


def test_demo_refuses_a_directory_it_did_not_make(tmp_path):
    (tmp_path / "mine").mkdir()
    result = CliRunner().invoke(app, ["demo", "--workdir", str(tmp_path / "mine")])
    assert result.exit_code == 1 and "not made by `moemerge demo`" in result.output
