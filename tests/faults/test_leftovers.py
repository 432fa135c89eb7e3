"""Item 13: a failed build removes the parent directories it created, and outputs get the
user's umask (not mkdtemp's 0700)."""

import os
import stat

import pytest
from conftest import write_recipe

from moemerge.api import build


@pytest.fixture
def umask():
    def set_(mask):
        os.umask(mask)

    old = os.umask(0o022)
    yield set_
    os.umask(old)


def test_failed_build_removes_the_parents_it_made(model_factory, tmp_path, monkeypatch):
    import moemerge.io.writer as writer

    base = model_factory("llama")
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{base}, {base}]\n")

    def fail(self, name, tensor):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.ShardedWriter, "write", fail)
    (tmp_path / "kept").mkdir()
    with pytest.raises(KeyboardInterrupt):
        build(recipe, tmp_path / "kept" / "a" / "b" / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "r.yaml"]
    assert list((tmp_path / "kept").iterdir()) == []


@pytest.mark.parametrize("mask, mode", [(0o022, 0o755), (0o027, 0o750), (0o002, 0o775)])
def test_outputs_honour_the_umask(model_factory, tmp_path, umask, mask, mode):
    base = model_factory("llama")
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{base}, {base}]\n")
    umask(mask)
    build(recipe, tmp_path / "out", progress=False, verify="structure")
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == mode
    for name in ("model.safetensors", "config.json"):  # weights like every other file
        assert stat.S_IMODE((tmp_path / "out" / name).stat().st_mode) == 0o666 & ~mask, name


def test_half_made_toy_sets_of_dead_processes_are_swept(tmp_path):
    import subprocess
    import sys

    from moemerge.toy import TINY, cached_toy_experts

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    root = tmp_path / "toy"
    (root / TINY.key()).mkdir(parents=True)  # a finished set: nothing to make
    (root / TINY.key() / "toyset.json").write_text("{}")
    stale = root / f".{TINY.key()}-{dead}-abcd"
    alive = root / f".{TINY.key()}-{os.getppid()}-efgh"
    stale.mkdir()
    alive.mkdir()
    with pytest.raises(KeyError):  # the stub toyset.json is no real set; the sweep came first
        cached_toy_experts(TINY, cache_dir=tmp_path, progress=False)
    assert not stale.exists() and alive.exists()
