"""ShardedWriter: byte-identical to save_file in any write order; sharding; refusals; parse_size."""

import json
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moemerge.errors import OutputError
from moemerge.io.writer import ShardedWriter, overwrite_tensors, parse_size

torch.set_num_threads(1)
TENSORS = {
    "model.layers.0.mlp.down_proj.weight": torch.randn(3, 5),
    "model.layers.0.input_layernorm.weight": torch.randn(7).bfloat16(),
    "model.embed_tokens.weight": torch.randn(4, 3).bfloat16(),
    "positions": torch.arange(5),
    "scale": torch.randn(2, 2).half(),
    "mask": torch.tensor([True, False, True]),
    "fp8": torch.randn(6).to(torch.float8_e4m3fn),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
    "ünïcode.weight": torch.randn(2),
}


def planned(tensors):
    return [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


@pytest.mark.parametrize("order", ["planned", "reversed", "shuffled"])
def test_byte_identical_to_save_file_in_any_order(tmp_path, order):
    save_file(TENSORS, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    names = list(TENSORS)
    if order == "reversed":
        names.reverse()
    elif order == "shuffled":
        random.Random(0).shuffle(names)
    (tmp_path / "out").mkdir()
    with ShardedWriter(tmp_path / "out", planned(TENSORS)) as writer:
        for name in names:
            writer.write(name, TENSORS[name])
    assert writer.shard_files == [tmp_path / "out" / "model.safetensors"]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (tmp_path / "ref.safetensors").read_bytes()
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_shards_with_an_index(tmp_path):
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    tensors["big"] = torch.ones(600)  # 2400 bytes: more than a shard, gets one of its own
    with ShardedWriter(tmp_path, planned(tensors), max_shard_bytes=1000,
                       metadata={"source": "test"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    names = [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)]
    assert [f.name for f in writer.shard_files] == names
    assert writer.total_bytes == 4400
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 4400}
    assert index["weight_map"] == {"t0": names[0], "t1": names[0], "t2": names[1],
                                   "t3": names[1], "t4": names[2], "big": names[3]}
    for name, file in index["weight_map"].items():
        with safe_open(tmp_path / file, "pt") as f:
            assert f.metadata() == {"format": "pt", "source": "test"}
            assert torch.equal(f.get_tensor(name), tensors[name])


def test_overwrite_tensors_in_place(tmp_path):
    """Across shards: the replaced tensors read back (cast to the file's dtype) and every other
    byte of every file is unchanged, so the result is what writing them in the first place
    gives; an unknown name or another shape is refused before any byte changes."""
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(4)}
    tensors["router"] = torch.zeros(4, 8).bfloat16()
    new = {"t1": torch.arange(100.0), "router": torch.randn(4, 8, dtype=torch.float64)}
    for directory, values in (("patched", tensors), ("direct", tensors | {
            "t1": new["t1"], "router": new["router"].bfloat16()})):
        (tmp_path / directory).mkdir()
        with ShardedWriter(tmp_path / directory, planned(tensors), max_shard_bytes=1000) as w:
            for name, tensor in values.items():
                w.write(name, tensor)
    overwrite_tensors(tmp_path / "patched", new)
    files = sorted(p.name for p in (tmp_path / "direct").iterdir())
    assert len(files) == 3  # two shards (t1 in the first, the router in the second), the index
    for name in files:
        patched, direct = (tmp_path / d / name for d in ("patched", "direct"))
        assert patched.read_bytes() == direct.read_bytes()
    before = {p.name: p.read_bytes() for p in (tmp_path / "patched").iterdir()}
    with pytest.raises(OutputError, match="'nope' is not in"):
        overwrite_tensors(tmp_path / "patched", {"t0": torch.ones(100), "nope": torch.ones(1)})
    with pytest.raises(OutputError, match=r"'router': .* holds \[4, 8\], got \[8, 4\]"):
        overwrite_tensors(tmp_path / "patched", {"t0": torch.ones(100),
                                                 "router": torch.ones(8, 4)})
    assert {p.name: p.read_bytes() for p in (tmp_path / "patched").iterdir()} == before


def test_files_are_presized_before_any_write(tmp_path):
    writer = ShardedWriter(tmp_path, planned(TENSORS))
    save_file(TENSORS, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "model.safetensors").stat().st_size == \
        (tmp_path / "ref.safetensors").stat().st_size
    writer._release()


def test_refuses_what_was_not_planned(tmp_path):
    writer = ShardedWriter(tmp_path, planned(TENSORS))
    with pytest.raises(OutputError, match="'extra' is not in the plan"):
        writer.write("extra", torch.zeros(1))
    with pytest.raises(OutputError, match=r"'positions': planned torch.int64 \[5\], got "
                                          r"torch.int64 \[6\]"):
        writer.write("positions", torch.arange(6))
    with pytest.raises(OutputError, match=r"'scale': planned torch.float16 \[2, 2\], got "
                                          r"torch.float32 \[2, 2\]"):
        writer.write("scale", torch.zeros(2, 2))
    writer.write("scale", TENSORS["scale"])
    with pytest.raises(OutputError, match="'scale' was already written"):
        writer.write("scale", TENSORS["scale"])
    with pytest.raises(OutputError, match=r"9 planned tensors were never written: "
                                          r"'model.layers.0.mlp.down_proj.weight'"):
        writer.close()
    with pytest.raises(OutputError, match="closed"):
        writer.write("positions", TENSORS["positions"])


def test_plan_errors(tmp_path):
    with pytest.raises(OutputError, match="twice"):
        ShardedWriter(tmp_path, [("a", torch.float32, (1,)), ("a", torch.float32, (1,))])
    with pytest.raises(OutputError, match="cannot store dtype"):
        ShardedWriter(tmp_path, [("a", torch.complex64, (1,))])


def test_exception_inside_keeps_its_own_error(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), ShardedWriter(tmp_path, planned(TENSORS)):
        raise RuntimeError("boom")  # not "tensors never written"
    assert not (tmp_path / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("text, size", [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30), ("1.5G", 1_500_000_000),
    ("100KB", 100_000), ("123", 123), (4096, 4096), (" 64 kib ", 65536), ("1.1GB", 1_100_000_000),
    ("5gb", 5 * 10**9), ("10M", 10**7), ("1TiB", 2**40), ("7B", 7),
])
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "five GB", "5XB", "0", -1, "-3MB", "0.1B", "1.2.3GB", True])
def test_parse_size_rejects_junk(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize("how", ["kernel", "buffered"])
def test_copy_puts_the_stored_bytes(tmp_path, monkeypatch, how):
    """Half the tensors copied from a stored file (by copy_file_range, or through a small
    reused buffer where the kernel refuses), half written: the save_file bytes."""
    import errno
    import os

    import moemerge.io.writer as writer_module
    from moemerge.io.reader import read_safetensors_header

    if how == "buffered":
        def refuse(*args):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", refuse)
        monkeypatch.setattr(writer_module, "COPY_BUFFER", 3)
    save_file(TENSORS, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    stored = read_safetensors_header(tmp_path / "ref.safetensors")
    (tmp_path / "out").mkdir()
    with ShardedWriter(tmp_path / "out", planned(TENSORS)) as writer:
        for i, name in enumerate(reversed(TENSORS)):
            if i % 2:
                writer.copy(name, stored[name])
            else:
                writer.write(name, TENSORS[name])
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.parametrize("kernel", [True, False])
def test_copy_from_a_file_cut_short_names_it(tmp_path, monkeypatch, kernel):
    import errno
    import os

    from moemerge.errors import CheckpointError
    from moemerge.io.reader import read_safetensors_header

    if not kernel:
        monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(
            OSError(errno.ENOSYS, "no")))
    tensors = {"big": torch.randn(1000)}
    src = tmp_path / "src.safetensors"
    save_file(tensors, src)
    stored = read_safetensors_header(src)["big"]
    os.truncate(src, src.stat().st_size - 100)  # changed after its header was read
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="ended early.*'big'"):
        with ShardedWriter(tmp_path / "out", planned(tensors)) as writer:
            writer.copy("big", stored)
    with pytest.raises(OutputError, match="planned torch.float32 \\[1000\\], got torch.float16"):
        with ShardedWriter(tmp_path / "out", planned(tensors)) as writer:
            writer.copy("big", read_safetensors_header(
                save_half(tmp_path / "half.safetensors"))["big"])


def save_half(file):
    save_file({"big": torch.randn(1000).half()}, file)
    return file
