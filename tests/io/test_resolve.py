"""resolve_model: local directories, paths that do not exist, hub ids (never the network)."""

import socket
from pathlib import Path

import huggingface_hub
import pytest

from moemerge.errors import CheckpointError
from moemerge.io.resolve import HUB_PATTERNS, resolve_model


def test_local_directory(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    assert resolve_model(str(tmp_path / "model")) == (tmp_path / "model").resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("model") == (tmp_path / "model").resolve()  # a dir wins over a hub id
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/model") == (tmp_path / "model").resolve()


@pytest.mark.parametrize("ref", ["./nope", "/no/such/dir", "~/nope", "a/b/c", "../nope", "we ird"])
def test_paths_that_do_not_exist_never_reach_the_hub(tmp_path, monkeypatch, ref):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", pytest.fail)
    with pytest.raises(CheckpointError, match="model directory .* does not exist"):
        resolve_model(ref)


def test_uncached_hub_id_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)

    def no_network(*args, **kwargs):
        raise AssertionError("tried the network although HF_HUB_OFFLINE is set")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(CheckpointError, match=r"some-org/some-model is not a local directory and "
                                              r"not in the Hugging Face cache.*hf download"):
        resolve_model("some-org/some-model")


def test_hub_id_download_arguments(tmp_path, monkeypatch):
    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert resolve_model("org/name", revision="v1") == tmp_path
    monkeypatch.setenv("HF_HUB_OFFLINE", "true")
    resolve_model("gpt2")
    assert calls == [
        ("org/name", {"revision": "v1", "allow_patterns": HUB_PATTERNS, "local_files_only": False}),
        ("gpt2", {"revision": None, "allow_patterns": HUB_PATTERNS, "local_files_only": True}),
    ]


def test_hub_failure_online_is_a_checkpoint_error(tmp_path, monkeypatch):
    def fake(repo_id, **kwargs):
        raise ConnectionError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(CheckpointError, match=r"org/name \(revision main\) .* could not be fetched"
                                              r".*ConnectionError: network is unreachable"):
        resolve_model("org/name", revision="main")


def test_bundled_recipe_before_the_toy_experts_says_how_to_make_them(tmp_path, monkeypatch):
    """`build recipes/toy_moe.yaml` before `moemerge toy recipes/toy`: no hub call (toy/base is
    one `/` and names no existing directory, so only the bundled-recipe rule keeps it local).
    Run on a copy of the bundled recipes without toy/ (a checkout may have made the experts),
    taken for the bundled directory."""
    import shutil
    from importlib import resources

    from moemerge.api import build
    from moemerge.plan import sources

    bundled = Path(str(resources.files("moemerge") / "recipes"))
    assert sources._bundled(bundled) and not sources._bundled(tmp_path)
    checkout = tmp_path / "checkout"
    shutil.copytree(bundled, checkout / "recipes", ignore=shutil.ignore_patterns("toy"))
    monkeypatch.setattr(sources, "_bundled", lambda d: d.resolve() == checkout / "recipes")
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: calls.append(a))
    monkeypatch.chdir(checkout)
    with pytest.raises(CheckpointError) as caught:
        build(Path("recipes/toy_moe.yaml"), tmp_path / "out", dry_run=True)
    assert calls == []
    assert str(caught.value).startswith("4 of 4 models not found")
    assert "model directory recipes/toy/base does not exist" in str(caught.value)
    assert "`moemerge toy recipes/toy`" in str(caught.value)


def test_a_copied_recipe_names_every_missing_model_and_where_it_looked(tmp_path, monkeypatch):
    """A bundled recipe copied elsewhere: one error lists the base and all three experts, says
    where relative paths are read, and names the places it looked; no hub call is made while a
    local path is missing (toy/base alone would be a hub id)."""
    from importlib import resources

    from moemerge.api import build

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    recipe = elsewhere / "toy_moe.yaml"
    text = (Path(str(resources.files("moemerge") / "recipes")) / "toy_moe.yaml").read_text()
    recipe.write_text(text.replace("init: calibrate", "init: prompts").split("calibration:")[0])
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: calls.append(a))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError) as caught:
        build(recipe, tmp_path / "out", dry_run=True)
    message = str(caught.value)
    assert calls == []
    assert message.startswith("4 of 4 models not found (relative paths are read next to the "
                              "recipe (elsewhere), then in the working directory")
    for name in ("code", "prose", "math"):
        assert (f"  - {name}: model directory toy/experts/{name} does not exist (looked for the "
                f"directory elsewhere/toy/experts/{name} next to the recipe and "
                f"toy/experts/{name} in the working directory)") in message
    assert ("  - base: no such directory (looked for the directory elsewhere/toy/base next to "
            "the recipe and toy/base in the working directory); as a hub id it is not looked "
            "up while a local model is missing") in message
