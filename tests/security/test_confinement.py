"""Item 5: files a model directory names (index entries, symlinked shards and side files,
directories finetune copies) must stay inside it; a hub snapshot's links into its cache's
blob store are allowed explicitly."""

import json
import os
import shutil

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.errors import CheckpointError
from moemerge.io.atomic import SIDE_FILES, copy_side_files
from moemerge.io.reader import CheckpointReader
from moemerge.train.export import _copy_side_files


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


def escaping(src, tmp_path, how):
    """A copy tmp_path/m of model `src` whose weights lie outside it, reached through an index
    entry (`../elsewhere.safetensors`, or its absolute path) or a symlinked shard."""
    outside = shutil.copy(src / "model.safetensors", tmp_path / "elsewhere.safetensors")
    model = shutil.copytree(src, tmp_path / "m")
    (model / "model.safetensors").unlink()  # transformers would prefer it to an index
    if how == "symlink":
        (model / "model.safetensors").symlink_to(outside)
        return model
    ref = "../elsewhere.safetensors" if how == "dotdot" else str(outside)
    index = {"metadata": {}, "weight_map": dict.fromkeys(CheckpointReader(src).metas, ref)}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return model


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_weights_outside_the_model_directory_are_refused(model_factory, tmp_path, how):
    base = model_factory("llama")
    model = escaping(base, tmp_path, how)
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{base}, {model}]\n")
    code, text = cli("build", recipe, tmp_path / "out")
    assert code == 1 and "outside the model directory" in text, text
    assert not (tmp_path / "out").exists()


def test_symlinked_side_file_is_never_copied(model_factory, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    base = shutil.copytree(model_factory("llama"), tmp_path / "base")
    (base / "chat_template.jinja").symlink_to(secret)
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{base}, {base}]\n")
    code, text = cli("build", recipe, tmp_path / "out")
    assert code == 1 and "chat_template.jinja" in text and "outside" in text, text
    assert not (tmp_path / "out").exists()


def test_finetune_copy_refuses_symlinked_directories(tmp_path):
    model = tmp_path / "model"
    (model / "extra").mkdir(parents=True)
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "key").write_text("secret")
    (model / "linked").symlink_to(tmp_path / "private")
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="linked .*outside the model directory"):
        _copy_side_files(model, tmp_path / "out")
    (model / "linked").unlink()
    (model / "extra" / "inner").symlink_to(tmp_path / "private" / "key")  # deeper down too
    with pytest.raises(CheckpointError, match="inner .*outside"):
        _copy_side_files(model, tmp_path / "out")


def hub_snapshot(model, tmp_path):
    """`model` laid out as huggingface_hub caches it: snapshots/<rev>/<file> ->
    ../../blobs/<hash>."""
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(p for p in model.iterdir() if p.is_file())):
        shutil.copy(file, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / file.name)
    return snapshot


def test_hub_snapshot_links_into_the_blob_store_are_allowed(model_factory, tmp_path):
    snapshot = hub_snapshot(model_factory("llama"), tmp_path)
    with CheckpointReader(snapshot) as reader:
        assert reader.read("model.embed_tokens.weight").shape[0] > 0
    (tmp_path / "out").mkdir()
    assert "tokenizer.json" in copy_side_files(snapshot, tmp_path / "out", SIDE_FILES)
    os.symlink(tmp_path / "hub" / "elsewhere", snapshot / "vocab.json")  # not into blobs/
    (tmp_path / "hub" / "elsewhere").write_text("{}")
    with pytest.raises(CheckpointError, match="vocab.json .*outside"):
        copy_side_files(snapshot, tmp_path / "out", SIDE_FILES)


@pytest.fixture(scope="module")
def seq_moe(model_factory, tmp_path_factory):
    """A tiny sequence-routed MoE: both `route` and `inspect --data` load it."""
    root = tmp_path_factory.mktemp("seq")
    base = model_factory("llama")
    recipe = write_recipe(root / "r.yaml", f"kind: moe\nassembly: seq_routed\nbase_model: "
                          f"{base}\nexperts: [{base}, {base}]\nexperts_per_sequence: 1\n")
    assert cli("build", recipe, root / "moe", "--verify", "structure")[0] == 0
    return root / "moe"


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_transformers_loads_are_confined_too(seq_moe, tmp_path, train_text, how):
    """`route` and `inspect --data` load through transformers, not CheckpointReader: the same
    confinement holds before transformers reads anything."""
    model = escaping(seq_moe, tmp_path, how)
    for args in (["route", model, train_text], ["inspect", model, "--data", f"code={train_text}"]):
        code, text = cli(*args)
        assert code == 1 and "outside the model directory" in text, (args, text)


def test_transformers_loads_a_hub_snapshot(seq_moe, tmp_path):
    """The blob-store allowance holds for transformers loads as well."""
    from moemerge.loading import load_pretrained

    model = load_pretrained("AutoModelForCausalLM", hub_snapshot(seq_moe, tmp_path))
    assert model.config.num_experts == 2
