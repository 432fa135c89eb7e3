"""Item 10 (disk full, read-only parent): a clean error naming the output and the space needed
against the space free, checked up front from the plan's size too; nothing is left behind."""

import errno
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app

ROOT = Path(__file__).resolve().parents[2]


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture
def recipe(model_factory, tmp_path):
    base = model_factory("llama")
    return write_recipe(tmp_path / "r.yaml", f"kind: merge\nmodels: [{base}, {base}]\n")


def test_too_little_space_is_refused_up_front(recipe, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    code, text = cli("build", recipe, tmp_path / "out")
    assert code == 1 and "not enough space for" in text and "out" in text, text
    assert "MiB free" in text and "needs about" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_enospc_while_writing_names_output_and_sizes(recipe, tmp_path, monkeypatch):
    import moemerge.io.writer as writer

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer.os, "pwrite", full)
    out = tmp_path / "deep" / "out"
    code, text = cli("build", recipe, out)
    assert code == 1 and f"no space left for {out} (No space left on device)" in text, text
    assert "MiB more" in text and "MiB are free" in text and "left behind" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_enospc_after_the_weights_names_output_and_sizes(recipe, tmp_path, monkeypatch):
    """A bare ENOSPC from any file of the output (here the tokenizer copy)."""
    real_copy = shutil.copy2

    def full(src, dst, **kwargs):
        if Path(src).name == "tokenizer.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real_copy(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copy2", full)
    out = tmp_path / "out"
    code, text = cli("build", recipe, out)
    expected = f"no space left for {out} (No space left on device) while writing tokenizer.json"
    assert code == 1 and expected in text, text
    assert "MiB more" in text and "MiB are free" in text and "left behind" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


FINETUNE = ["--seq-len", "16", "--batch-size", "2", "--steps", "2", "--save-every", "1", "-q"]


def test_finetune_checks_space_before_training(tiny_moe, train_text, tmp_path, monkeypatch):
    from moemerge.train import loop

    def never(*args, **kwargs):
        raise AssertionError("training started")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr(loop, "run", never)
    out = tmp_path / "out"
    code, text = cli("finetune", tiny_moe, out, "--data", train_text, *FINETUNE)
    assert code == 1 and f"not enough space for {out} and 3 training checkpoints" in text, text
    assert "needs about" in text and "MiB free" in text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed "
                 "writing file data/3: file write failed"),
])
def test_finetune_checkpoint_on_a_full_disk(tiny_moe, train_text, tmp_path, monkeypatch, error):
    import torch

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "out"
    code, text = cli("finetune", tiny_moe, out, "--data", train_text, *FINETUNE)
    step = f"{out}.checkpoints/step-1"
    assert code == 1 and "Traceback" not in text, text
    assert (f"no space left for {step} (No space left on device)" in text
            if isinstance(error, OSError) else f"cannot write the checkpoint {step} (" in text)
    assert "MiB more" in text and "MiB are free" in text and "left behind" in text, text
    assert list(tmp_path.iterdir()) == []


def test_file_size_limit_is_a_clean_error(recipe, tmp_path):
    """`ulimit -f` (RLIMIT_FSIZE): a real EFBIG from the kernel, in a child process."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a core dump
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH",
                                                                                  "")])}
    done = subprocess.run([sys.executable, "-m", "moemerge", "build", str(recipe),
                           str(tmp_path / "out"), "-q"], env=env, preexec_fn=limit,
                          capture_output=True, text=True, timeout=300)
    text = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1 and "File too large" in text and "Traceback" not in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_read_only_parent(recipe, tmp_path, monkeypatch):
    import tempfile

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "ro"))

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(tempfile, "mkdtemp", refused)  # what a read-only directory answers
    code, text = cli("build", recipe, tmp_path / "ro" / "out")
    assert code == 1 and "cannot create the output" in text and "Permission denied" in text, text


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_parent_for_real(recipe, tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    code, text = cli("build", recipe, tmp_path / "ro" / "out")
    assert code == 1 and "cannot create the output" in text, text
