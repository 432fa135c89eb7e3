"""Every command that reads or copies files of a model directory refuses one whose files
reach outside it, also when the directory is given as a relative path (a path already joined
to a relative directory was once joined twice, so its links were never checked: finetune
copied /etc/passwd into its output as notes.txt and extras/passwd, exit 0).

READERS enumerates them: build (merge, upcycle, calibrate), finetune, bake, route,
inspect task-vectors, inspect routing. import-mergekit reads no model directory (only the
config it translates)."""

import shutil

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app
from moemerge.errors import CheckpointError
from moemerge.io.reader import CheckpointReader, check_model_dir_confined, read_config
from moemerge.train.export import _copy_side_files

MARKER = "root:x:0:0:marker outside the model directory"


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture
def project(model_factory, tiny_moe, tmp_path, monkeypatch, train_text):
    """In the working directory (all paths relative): dense/ (a llama), moe/ (token-routed),
    seq/ (sequence-routed), text.txt, and ../outside/ holding a marker file."""
    base = model_factory("llama")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "passwd").write_text(MARKER)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    shutil.copytree(base, "dense")
    shutil.copytree(tiny_moe, "moe")
    shutil.copy(train_text, "text.txt")
    write_recipe(work / "seq.yaml", "kind: moe\nassembly: seq_routed\nbase_model: dense\n"
                 "experts: [dense, dense]\nexperts_per_sequence: 1\n")
    assert cli("build", "seq.yaml", "seq", "--verify", "structure", "-q")[0] == 0
    return tmp_path


def link_config_outside(model: str, root):
    """model/config.json -> ../../outside/<model>-config.json (a valid copy, outside)."""
    outside = root / "outside" / f"{model}-config.json"
    shutil.move(f"{model}/config.json", outside)
    (root / "work" / model / "config.json").symlink_to(f"../../outside/{outside.name}")


READERS = {
    "build merge": ("dense", ["build", "merge.yaml", "out", "-q"]),
    "build upcycle": ("dense", ["build", "upcycle.yaml", "out", "-q"]),
    "build calibrate": ("dense", ["build", "calibrate.yaml", "out", "-q"]),
    "finetune": ("moe", ["finetune", "moe", "out", "--data", "text.txt", "-q", "--steps", "1"]),
    "bake": ("moe", ["bake", "moe", "out"]),
    "extract": ("moe", ["extract", "moe", "out", "--expert", "0"]),
    "extend": ("moe", ["extend", "moe", "out", "--expert", "dense", "--calibration",
                       "text.txt", "--keep-shared"]),
    "shrink": ("moe", ["shrink", "moe", "out", "--experts", "1", "--calibration", "text.txt",
                       "--seq-len", "16"]),
    "route": ("seq", ["route", "seq", "text.txt"]),
    "inspect task-vectors": ("dense", ["inspect", "task-vectors", "dense", "moe2", "-q"]),
    "inspect routing": ("moe", ["inspect", "routing", "moe", "--data", "code=text.txt"]),
}


def recipes(work):
    write_recipe(work / "merge.yaml", "kind: merge\nmodels: [dense, dense]\n")
    write_recipe(work / "upcycle.yaml", "kind: upcycle\nmodel: dense\nexperts: 2\n"
                 "experts_per_token: 1\n")
    write_recipe(work / "calibrate.yaml", "kind: moe\nbase_model: dense\nexperts: [dense, "
                 "dense]\nexperts_per_token: 1\nrouter: {init: calibrate}\n"
                 "calibration: {data: [text.txt], max_tokens: 256, seq_len: 16}\n")
    shutil.copytree(work / "dense", work / "moe2")


@pytest.mark.parametrize("reader", sorted(READERS))
def test_a_config_linked_outside_is_refused_by_every_reader(project, reader):
    model, argv = READERS[reader]
    work = project / "work"
    recipes(work)
    link_config_outside(model, project)
    code, text = cli(*argv)
    assert code == 1 and "config.json" in text and "outside the model directory" in text, text
    assert not (work / "out").exists()


@pytest.mark.parametrize("how", ["notes.txt", "extras/passwd", "extras"])
def test_finetune_never_copies_side_files_from_outside(project, how):
    """The issue's payloads, relative links and a relative model directory: a file, a file in
    a nested directory, and a nested directory that is itself a link."""
    work = project / "work"
    if how == "extras":
        (work / "moe" / "extras").symlink_to("../../outside")
    else:
        (work / "moe" / how).parent.mkdir(exist_ok=True)
        depth = "../" * (how.count("/") + 2)
        (work / "moe" / how).symlink_to(f"{depth}outside/passwd")
    code, text = cli("finetune", "moe", "out", "--data", "text.txt", "-q", "--steps", "1")
    assert code == 1 and how.split("/")[-1] in text and "outside" in text, text
    assert not (work / "out").exists()
    (work / "copy").mkdir()  # the copy itself refuses, whatever loaded the model before it
    with pytest.raises(CheckpointError, match="outside the model directory"):
        _copy_side_files(__import__("pathlib").Path("moe"), work / "copy")
    assert not any(MARKER in p.read_text() for p in (work / "copy").rglob("*") if p.is_file())


def test_relative_directories_are_checked_like_absolute_ones(project):
    """The functions themselves, on a relative directory: config.json, an index and the
    whole tree."""
    from pathlib import Path

    work = project / "work"
    link_config_outside("dense", project)
    for check in (read_config, CheckpointReader, check_model_dir_confined):
        with pytest.raises(CheckpointError, match="config.json .*outside"):
            check(Path("dense"))
        with pytest.raises(CheckpointError, match="config.json .*outside"):
            check(Path("./dense"))
    (work / "dense" / "config.json").unlink()
    shutil.copy(project / "outside" / "dense-config.json", work / "dense" / "config.json")
    read_config(Path("dense"))  # inside again: fine
    (work / "dense" / "model.safetensors.index.json").symlink_to("../../outside/passwd")
    with pytest.raises(CheckpointError, match="model.safetensors.index.json .*outside"):
        check_model_dir_confined(Path("dense"))
