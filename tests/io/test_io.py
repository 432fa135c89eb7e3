"""Reader, streaming writer, atomic output directory and model resolution."""

import json
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moemerge.errors import CheckpointError, OutputError
from moemerge.io.atomic import atomic_output_dir, copy_side_files
from moemerge.io.reader import CheckpointReader
from moemerge.io.resolve import resolve_model
from moemerge.io.writer import ShardedWriter, parse_size

TENSORS = {
    "layer.b.weight": torch.randn(3, 5),
    "layer.a.weight": torch.randn(7).bfloat16(),
    "positions": torch.arange(5),
    "scale": torch.randn(2, 2).half(),
}


def planned(tensors):
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def checkpoint(directory, tensors=TENSORS, shards=1):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"model_type": "llama"}')
    names = list(tensors)
    if shards == 1:
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    weight_map = {}
    for i in range(shards):
        file = f"part-{i}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, directory / file)
        weight_map |= dict.fromkeys(part, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.mark.parametrize("shards", [1, 2])
def test_reader_headers_then_one_tensor_at_a_time(tmp_path, shards):
    with CheckpointReader(checkpoint(tmp_path / "m", shards=shards), max_open_files=1) as reader:
        assert reader.config["model_type"] == "llama"
        assert set(reader.names()) == set(TENSORS) and "scale" in reader
        assert reader.meta("layer.a.weight").shape == (7,)
        assert reader.total_bytes == sum(t.numel() * t.element_size() for t in TENSORS.values())
        for name, tensor in TENSORS.items():
            assert torch.equal(reader.read(name), tensor)
    assert torch.equal(reader.read("scale"), TENSORS["scale"])  # reopens after close


def test_truncated_file_is_named(tmp_path):
    directory = checkpoint(tmp_path / "m")
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"m/model\.safetensors is truncated: tensor"):
        CheckpointReader(directory)
    file.write_bytes(b"\x10\x00")
    with pytest.raises(CheckpointError, match="truncated or empty"):
        CheckpointReader(directory)


def test_corrupt_header(tmp_path):
    directory = checkpoint(tmp_path / "m")
    (directory / "model.safetensors").write_bytes((8).to_bytes(8, "little") + b"{not json")
    with pytest.raises(CheckpointError, match="cannot read the safetensors header"):
        CheckpointReader(directory)


def test_missing_shard_and_missing_config(tmp_path):
    directory = checkpoint(tmp_path / "m", shards=2)
    (directory / "part-1.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"part-1\.safetensors is listed in .* but missing"):
        CheckpointReader(directory)
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        CheckpointReader(directory)
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "elsewhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="holds no weights"):
        CheckpointReader(tmp_path / "empty")


def test_pickles_refused_unless_allowed(tmp_path):
    directory = tmp_path / "p"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    torch.save(TENSORS, directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickled checkpoint.*--allow-pickle"):
        CheckpointReader(directory)
    with CheckpointReader(directory, allow_pickle=True) as reader:
        assert torch.equal(reader.read("positions"), TENSORS["positions"])


def test_writer_is_byte_identical_to_save_file_in_any_order(tmp_path):
    save_file(TENSORS, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    (tmp_path / "out").mkdir()
    with ShardedWriter(tmp_path / "out", planned(TENSORS)) as writer:
        for name in reversed(list(TENSORS)):
            writer.write(name, TENSORS[name])
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (tmp_path / "ref.safetensors").read_bytes()
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_writer_shards_with_an_index(tmp_path):
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    with ShardedWriter(tmp_path, planned(tensors), max_shard_bytes=1000) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2000
    assert sorted(set(index["weight_map"].values())) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for name, file in index["weight_map"].items():
        with safe_open(tmp_path / file, "pt") as f:
            assert torch.equal(f.get_tensor(name), tensors[name])


def test_writer_refuses_what_was_not_planned(tmp_path):
    writer = ShardedWriter(tmp_path, planned(TENSORS))
    with pytest.raises(OutputError, match="not in the plan"):
        writer.write("extra", torch.zeros(1))
    with pytest.raises(OutputError, match=r"planned torch.float32 \[3, 5\], got"):
        writer.write("layer.b.weight", torch.zeros(5, 3))
    with pytest.raises(OutputError, match="planned torch.float16"):
        writer.write("scale", torch.zeros(2, 2))
    writer.write("scale", TENSORS["scale"])
    with pytest.raises(OutputError, match="already written"):
        writer.write("scale", TENSORS["scale"])
    with pytest.raises(OutputError, match="never written"):
        writer.close()


@pytest.mark.parametrize("text, size", [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5G", 1_500_000_000),
    ("100KB", 100_000), ("123", 123), (4096, 4096), (" 64 kib ", 65536),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "five GB", "5XB", "0", -1, "-3MB"])
def test_parse_size_rejects_junk(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_atomic_dir_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError), atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "half.safetensors").write_bytes(b"x")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_refuses_then_replaces_with_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(OutputError, match="already exists"), atomic_output_dir(out):
        pass
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("new")
        assert (out / "old").exists()  # the old output stays until the new one is complete
    assert [p.name for p in out.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_copy_side_files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "dst").mkdir()
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    assert copy_side_files(tmp_path / "src", tmp_path / "dst", ["tokenizer.json", "vocab.txt"]) \
        == ["tokenizer.json"]


def test_resolve_local_and_missing(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))


def test_uncached_hub_id_offline_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache.*HF_HUB_OFFLINE"):
        resolve_model("some-org/some-model")
    assert time.monotonic() - start < 10
