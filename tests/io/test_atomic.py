"""atomic_output_dir: whole or nothing; copy_side_files."""

import pytest

from moemerge.errors import OutputError
from moemerge.io.atomic import atomic_output_dir, copy_side_files


def test_success_renames_into_place(tmp_path):
    out = tmp_path / "deep" / "out"
    with atomic_output_dir(out) as tmp:
        assert tmp.parent == out.parent and tmp.name.startswith(".out.moemerge-tmp-")
        assert not out.exists()  # nothing named `out` until the build is complete
        (tmp / "model.safetensors").write_bytes(b"x")
    assert [p.name for p in out.parent.iterdir()] == ["out"]
    assert (out / "model.safetensors").read_bytes() == b"x"


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_leaves_nothing(tmp_path, error):
    with pytest.raises(error), atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "half.safetensors").write_bytes(b"x")
        raise error("killed")
    assert list(tmp_path.iterdir()) == []


def test_refuses_existing_then_replaces_with_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(OutputError, match="out already exists; pass --force"):
        with atomic_output_dir(out):
            raise AssertionError("must refuse before yielding")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temp dir created
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("new")
        assert (out / "old").exists()  # the old output stays until the new one is complete
    assert [p.name for p in out.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_failed_forced_build_keeps_the_old_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(RuntimeError), atomic_output_dir(out, force=True):
        raise RuntimeError("killed")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in out.iterdir()] == ["old"]


def test_out_appearing_during_the_build_is_not_overwritten(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="appeared while building"):
        with atomic_output_dir(out):
            out.mkdir()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_copy_side_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "dst").mkdir()
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    (tmp_path / "src" / "special_tokens_map.json").write_text("[]")
    copied = copy_side_files(tmp_path / "src", tmp_path / "dst",
                             ["tokenizer.json", "vocab.txt", "special_tokens_map.json"])
    assert copied == ["tokenizer.json", "special_tokens_map.json"]
    assert (tmp_path / "dst" / "special_tokens_map.json").read_text() == "[]"
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == sorted(copied)
