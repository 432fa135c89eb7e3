"""Item 12: checkpoints are fsynced (files, then the directory, before the rename), and a
truncated latest state.pt falls back to the checkpoint before it with a warning."""

import os

from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.train import checkpoint


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


def test_truncated_latest_falls_back_and_retraces(tiny_moe, train_text, tmp_path):
    args = ["--data", train_text, "--seq-len", "16", "--batch-size", "2", "--steps", "3",
            "--save-every", "1"]
    out = tmp_path / "out"
    code, text = cli("finetune", tiny_moe, out, *args, "-q")
    assert code == 0, text
    reference = (out / "model.safetensors").read_bytes()
    root = checkpoint.checkpoint_root(out)
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]  # the last: OUT
    state = root / "step-2" / checkpoint.STATE
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    code, text = cli("finetune", tiny_moe, out, *args, "--resume", "--force")
    assert code == 0, text
    flat = "".join(text.split())  # the console wraps long paths
    assert "warning" in text and "step-2/state.pt" in flat and "truncated" in text, text
    assert "falling back" in text and "step-1(step1)" in flat
    assert (out / "model.safetensors").read_bytes() == reference


def test_checkpoint_files_and_directory_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    synced, renamed = [], []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", lambda a, b: (renamed.append((len(synced), b)),
                                                     real_rename(a, b))[1])
    checkpoint.save(tmp_path, 1, {"x": 1}, keep=2)
    (count, final), = renamed
    before = synced[:count]
    assert str(final).endswith("step-1")
    assert any(p.endswith("/state.pt") for p in before)  # the file
    assert any(".step-1.tmp-" in p and not p.endswith(".pt") for p in before)  # its directory
    assert synced[count:] == [str(tmp_path)]  # the rename itself
