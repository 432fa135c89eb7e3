"""Item 3: no Python from a model directory ever runs, and transformers never asks. The model
directories carry `auto_map` entries (config and tokenizer) naming a module that writes a
marker file when imported; stdin answers "y" in case anything asks."""

import json
import shutil

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app

EVIL = """open({marker!r}, "w").write("ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig): pass
class EvilModel(LlamaForCausalLM): pass
class EvilTokenizer(PreTrainedTokenizerFast): pass
"""


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args], input="y\ny\ny\n")
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "[y/N]" not in result.output
    return result.exit_code, " ".join(result.output.split())


def booby_trap(directory, marker, *, tokenizer: bool):
    """Add an auto_map to config.json (and tokenizer_config.json) naming evil.py."""
    (directory / "evil.py").write_text(EVIL.format(marker=str(marker)))
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig",
                          "AutoModelForCausalLM": "evil.EvilModel"}
    (directory / "config.json").write_text(json.dumps(config))
    if tokenizer:
        tok = json.loads((directory / "tokenizer_config.json").read_text())
        tok |= {"auto_map": {"AutoTokenizer": [None, "evil.EvilTokenizer"]},
                "tokenizer_class": "EvilTokenizer"}
        (directory / "tokenizer_config.json").write_text(json.dumps(tok))
    return directory


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "code from a model directory ran"


def test_build_with_prompt_router_never_runs_the_tokenizer_code(model_factory, tmp_path, marker):
    base = booby_trap(shutil.copytree(model_factory("llama"), tmp_path / "base"), marker,
                      tokenizer=True)
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: moe\nbase_model: {base}\nexperts:\n"
                          f"  - {{model: {base}, name: a, positive_prompts: [def]}}\n"
                          f"  - {{model: {base}, name: b, positive_prompts: [The]}}\n"
                          "router: {init: prompts}\n")
    code, text = cli("build", recipe, tmp_path / "out")
    assert code == 1 and "custom code" in text and "trust_remote_code" in text, text
    assert not (tmp_path / "out").exists()


def test_dense_merge_drops_auto_map_and_loads_with_installed_code(model_factory, tmp_path,
                                                                  marker):
    src = booby_trap(shutil.copytree(model_factory("llama"), tmp_path / "src"), marker,
                     tokenizer=False)
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{src}, {src}]\n")
    code, text = cli("build", recipe, tmp_path / "out", "--verify", "full")
    assert code == 0, text
    assert "auto_map" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert not (tmp_path / "out" / "evil.py").exists()


def test_inspect_and_finetune_never_run_model_code(tiny_moe, train_text, tmp_path, marker):
    moe = booby_trap(shutil.copytree(tiny_moe, tmp_path / "moe"), marker, tokenizer=False)
    code, text = cli("inspect", moe, "--data", f"code={train_text}")
    assert code == 0, text
    code, text = cli("finetune", moe, tmp_path / "out", "--data", train_text, "--seq-len", "16",
                     "--steps", "1", "-q")
    assert code == 0, text
    booby_trap(moe, marker, tokenizer=True)  # transformers may then refuse, or ignore it
    code, text = cli("finetune", moe, tmp_path / "out2", "--data", train_text, "--seq-len",
                     "16", "--steps", "1", "-q")
    assert code == 0 or (code == 1 and "trust_remote_code" in text), text
