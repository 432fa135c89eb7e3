"""Items 2 and 4: nothing moemerge reads is unpickled into objects: `finetune --resume` loads
its state with weights_only=True, and a .bin reached through a safetensors index is refused
like any other pickle. Each payload would write a marker file; it must never appear."""

import json
import os
import shutil

import torch
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.train.checkpoint import checkpoint_root


class Payload:
    """Unpickling this runs `touch marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


def test_resume_never_unpickles(tiny_moe, train_text, tmp_path):
    marker = tmp_path / "pwned"
    out = tmp_path / "out"
    step = checkpoint_root(out) / "step-1"
    step.mkdir(parents=True)
    torch.save({"step": 1, "fingerprint": Payload(marker)}, step / "state.pt")
    code, text = cli("finetune", tiny_moe, out, "--data", train_text, "--seq-len", "16",
                     "--steps", "2", "--resume", "-q")
    assert code == 1 and "state.pt" in text and "pickled objects" in text, text
    assert "posix.system" in text
    assert not marker.exists() and not out.exists()


def test_bin_listed_in_a_safetensors_index_is_refused(model_factory, tmp_path):
    marker = tmp_path / "pwned"
    base = model_factory("llama")
    evil = shutil.copytree(base, tmp_path / "evil")
    (evil / "model.safetensors").unlink()
    state = {"model.embed_tokens.weight": Payload(marker)}
    torch.save(state, evil / "pytorch_model.bin")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "pytorch_model.bin"}}
    (evil / "model.safetensors.index.json").write_text(json.dumps(index))
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{base}, {evil}]\n")
    code, text = cli("build", recipe, tmp_path / "out")
    assert code == 1 and "pickled checkpoint" in text and "pytorch_model.bin" in text, text
    code, text = cli("build", recipe, tmp_path / "out", "--allow-pickle")  # weights_only=True
    assert code == 1 and "pytorch_model.bin" in text, text
    assert not marker.exists() and not (tmp_path / "out").exists()
