"""CheckpointReader: headers without data, one tensor at a time, every way a checkpoint breaks."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

import moemerge.io.reader as reader_module
from moemerge.errors import CheckpointError
from moemerge.io.reader import CheckpointReader

torch.set_num_threads(1)
TENSORS = {
    "layer.b.weight": torch.randn(3, 5),
    "layer.a.weight": torch.randn(7).bfloat16(),
    "positions": torch.arange(5),
    "scale": torch.randn(2, 2).half(),
}


def checkpoint(directory, tensors=TENSORS, shards=1):
    """A model directory: config.json plus one model.safetensors or `shards` indexed parts."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    if shards == 1:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    names, weight_map = list(tensors), {}
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, directory / f"part-{i}.safetensors")
        weight_map |= dict.fromkeys(part, f"part-{i}.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def raw_safetensors(file, header: dict, data: bytes = b""):
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("shards", [1, 2])
def test_headers_then_one_tensor_at_a_time(tmp_path, shards):
    with CheckpointReader(checkpoint(tmp_path / "m", shards=shards), max_open_files=1) as reader:
        assert reader.config == {"model_type": "llama"}
        assert sorted(reader.names()) == sorted(TENSORS) and "scale" in reader
        assert "nope" not in reader
        meta = reader.meta("layer.a.weight")
        assert (meta.dtype, meta.shape, meta.nbytes) == (torch.bfloat16, (7,), 14)
        assert reader.total_bytes == sum(t.numel() * t.element_size() for t in TENSORS.values())
        for name, tensor in TENSORS.items():
            assert torch.equal(reader.read(name), tensor)
            assert len(reader._handles) <= 1  # the LRU closes the older file
        kept = reader.read("scale")
    assert not reader._handles
    assert torch.equal(kept * 1, TENSORS["scale"])  # owns its memory after the handle closed


def test_names_follow_file_order(tmp_path):
    with CheckpointReader(checkpoint(tmp_path / "m")) as reader:
        offsets = [reader.meta(n) for n in reader.names()]
    # save_file lays out wider dtypes first: f32/i64 before f16/bf16
    assert [m.dtype.itemsize for m in offsets] == sorted(
        (m.dtype.itemsize for m in offsets), reverse=True)


def test_building_metadata_reads_no_tensor_data(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tensor data read while reading headers")

    monkeypatch.setattr(reader_module.RawFile, "read", refuse)
    with CheckpointReader(checkpoint(tmp_path / "m", shards=2)) as reader:
        meta = reader.meta("scale")
        assert (meta.name, meta.dtype, meta.shape, meta.file) == (
            "scale", torch.float16, (2, 2), tmp_path / "m" / "part-1.safetensors")


def test_unknown_tensor_is_named(tmp_path):
    with (CheckpointReader(checkpoint(tmp_path / "m")) as reader,
          pytest.raises(CheckpointError, match=r"'lm_head.weight' is not in .*m")):
        reader.read("lm_head.weight")


def test_truncated_file_is_named(tmp_path):
    file = checkpoint(tmp_path / "m") / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"m/model\.safetensors is truncated: tensor "
                                              r"'.*' needs bytes up to \d+ but the file has \d+"):
        CheckpointReader(tmp_path / "m")
    file.write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match="truncated or empty"):
        CheckpointReader(tmp_path / "m")


def test_corrupt_headers(tmp_path):
    file = checkpoint(tmp_path / "m") / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 9) + b"{not json")
    with pytest.raises(CheckpointError, match="cannot read the safetensors header"):
        CheckpointReader(tmp_path / "m")
    file.write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(CheckpointError, match="header claims 1000000000000 bytes"):
        CheckpointReader(tmp_path / "m")
    raw_safetensors(file, {"x": {"dtype": "F17", "shape": [1], "data_offsets": [0, 4]}}, b"0000")
    with pytest.raises(CheckpointError, match="unknown dtype 'F17'"):
        CheckpointReader(tmp_path / "m")
    raw_safetensors(file, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"0000")
    with pytest.raises(CheckpointError, match=r"do not fit its shape \[2\]"):
        CheckpointReader(tmp_path / "m")
    raw_safetensors(file, {"x": {"dtype": "F32"}})
    with pytest.raises(CheckpointError, match="malformed header entry for tensor 'x'"):
        CheckpointReader(tmp_path / "m")


def test_missing_shard_config_and_weights(tmp_path):
    directory = checkpoint(tmp_path / "m", shards=2)
    (directory / "part-1.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"shard .*part-1\.safetensors is listed in"):
        CheckpointReader(directory)
    (directory / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        CheckpointReader(directory)
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"m/config\.json is missing"):
        CheckpointReader(directory)
    with pytest.raises(CheckpointError, match="model directory .*elsewhere does not exist"):
        CheckpointReader(tmp_path / "elsewhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="empty holds no weights"):
        CheckpointReader(tmp_path / "empty")


def test_same_tensor_in_two_files(tmp_path):
    directory = checkpoint(tmp_path / "m")
    (directory / "model.safetensors").rename(directory / "a.safetensors")
    save_file({"scale": torch.zeros(1)}, directory / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"'scale' is in both .*a\.safetensors and"):
        CheckpointReader(directory)


def test_safetensors_preferred_over_pickles(tmp_path):
    directory = checkpoint(tmp_path / "m")
    # hub repos often ship both formats; the .bin index is a .json and is downloaded too
    (directory / "pytorch_model.bin.index.json").write_text('{"weight_map": {"x": "a.bin"}}')
    with CheckpointReader(directory) as reader:
        assert sorted(reader.names()) == sorted(TENSORS)


@pytest.mark.parametrize("indexed", [False, True])
def test_pickles_refused_unless_allowed(tmp_path, indexed):
    directory = tmp_path / "p"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    file = "pytorch_model-00001-of-00001.bin" if indexed else "pytorch_model.bin"
    torch.save(TENSORS, directory / file)
    if indexed:
        (directory / "pytorch_model.bin.index.json").write_text(
            json.dumps({"weight_map": dict.fromkeys(TENSORS, file)}))
    with pytest.raises(CheckpointError, match=r"\.bin is a pickled checkpoint; pickles can run "
                                              "code when loaded.*--allow-pickle"):
        CheckpointReader(directory)
    with CheckpointReader(directory, allow_pickle=True) as reader:
        assert reader.meta("layer.a.weight").dtype == torch.bfloat16
        for name, tensor in TENSORS.items():
            assert torch.equal(reader.read(name), tensor)


def test_a_relative_model_directory_reads(model_factory, tmp_path, monkeypatch):
    """`moemerge demo` builds into a relative directory; its weight files must not be joined to
    the directory twice."""
    import shutil

    shutil.copytree(model_factory("llama"), tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    with CheckpointReader("m") as reader:
        assert reader.read("model.embed_tokens.weight").shape[0] == 300


@pytest.mark.parametrize("window", [6, 4096, 64 * 2**20])
def test_non_finite_counted_in_place_window_by_window(tmp_path, monkeypatch, window):
    """count_non_finite_stored maps the file a window at a time (windows that start off a page
    boundary, values that cross none): the same count as the tensor read whole."""
    monkeypatch.setattr(reader_module, "MAP_WINDOW", window)
    values = torch.randn(4099).bfloat16()
    values[[0, 1, 2048, 4098]] = torch.tensor([float("nan"), float("inf"), -float("inf"),
                                               float("nan")]).bfloat16()
    tensors = {"a": torch.randn(3), "b": values, "c": torch.arange(4), "d": torch.zeros(0),
               "e": torch.randn(5, 3).half()}
    with CheckpointReader(checkpoint(tmp_path / "m", tensors)) as reader:
        counts = {n: reader_module.count_non_finite_stored(reader.stored(n)) for n in tensors}
        assert reader.stored("b").offset > 8 and reader.stored("b").offset % 4096  # off a page
    assert counts == {"a": 0, "b": 4, "c": 0, "d": 0, "e": 0}


def test_stored_is_none_for_a_pickle(tmp_path):
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text('{"model_type": "llama"}')
    torch.save({"w": torch.randn(2)}, directory / "pytorch_model.bin")
    with CheckpointReader(directory, allow_pickle=True) as reader:
        assert reader.stored("w") is None


def test_tensors_read_land_on_huge_pages(tmp_path):
    """`import moemerge` before torch puts large tensors on transparent huge pages: reading a
    64 MiB tensor faults in tens of pages, not 16k (a user's own THP_MEM_ALLOC_ENABLE wins)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not setting.is_file() or "[never]" in setting.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    save_file({"w": torch.zeros(16 * 2**20)}, tmp_path / "w.safetensors")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    script = ("import resource, moemerge, torch\nfrom moemerge.io.reader import CheckpointReader\n"
              "r = CheckpointReader(__import__('sys').argv[1])\n"
              "f = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\nr.read('w')\n"
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)")
    def faults(**env):
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True,
                              capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items()
                                   if k != "THP_MEM_ALLOC_ENABLE"} | env)
        return int(done.stdout.split()[-1])
    assert faults() < 2000 < 16384 <= faults(THP_MEM_ALLOC_ENABLE="0")
