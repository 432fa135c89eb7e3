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
    one `/` and names no existing directory, so only the bundled-recipe rule keeps it local)."""
    from importlib import resources

    from moemerge.api import build

    bundled = Path(str(resources.files("moemerge") / "recipes"))
    if (bundled / "toy").exists():
        pytest.skip("recipes/toy exists in this checkout")
    calls = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: calls.append(a))
    monkeypatch.chdir(bundled.resolve().parent)  # a checkout's root, or site-packages/moemerge
    with pytest.raises(CheckpointError) as caught:
        build(Path("recipes/toy_moe.yaml"), tmp_path / "out", dry_run=True)
    assert calls == []
    assert "model directory recipes/toy/base does not exist" in str(caught.value)
    assert "`moemerge toy recipes/toy`" in str(caught.value)
