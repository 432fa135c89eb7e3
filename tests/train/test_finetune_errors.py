"""Bad finetune input: a clear message and the documented exit code (1 runtime, 2 usage)."""

import torch
from typer.testing import CliRunner

from moemerge.cli import app

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, ["finetune", *map(str, args), "-q"])
    return result.exit_code, " ".join(result.output.split())


def test_bad_data(model_factory, tmp_path):
    dense = model_factory("llama")
    (tmp_path / "empty.txt").write_text("")
    code, text = run(dense, tmp_path / "o", "--data", tmp_path / "empty.txt")
    assert code == 2 and "empty.txt: empty file" in text
    (tmp_path / "short.txt").write_text("def add(a, b): return a + b\n")
    code, text = run(dense, tmp_path / "o", "--data", tmp_path / "short.txt", "--seq-len", "64")
    assert code == 2 and "short" in text and "--seq-len" in text
    code, text = run(dense, tmp_path / "o", "--data", tmp_path / "missing.txt")
    assert code == 2 and "missing.txt: no such file or directory" in text
    code, text = run(dense, tmp_path / "o", "--data", "org/some-dataset")  # offline: no hub
    assert code == 2 and ("cannot load it with datasets" in text
                          or "needs the 'datasets' package" in text), text
    assert not (tmp_path / "o").exists()


def test_not_an_moe(model_factory, tmp_path):
    dense = model_factory("llama")
    (tmp_path / "t.txt").write_text("def add(a, b):\n    return a + b\n" * 200)
    common = ("--data", tmp_path / "t.txt", "--seq-len", "16")
    code, text = run(dense, tmp_path / "o", *common, "--router-only")
    assert code == 1 and "is not an MoE" in text and "has no routers to train" in text
    assert "--full" in text  # says what a dense model can do
    code, text = run(dense, tmp_path / "o", *common, "--router-only", "--full")
    assert code == 2 and "only one of" in text
    code, text = run(dense, tmp_path / "o", *common, "--fsdp")  # accepted: one process, unsharded
    assert code == 1 and "is not an MoE" in text
    code, text = run(dense, tmp_path / "o", *common, "--full", "--aux-loss-coef", "0.01")
    assert code == 2 and "is dense; there is no router to balance" in text
    assert not (tmp_path / "o").exists()


def test_dense_model_trains_whole_with_full(model_factory, tmp_path):
    """The compute-matched dense control from the command line: every tensor moves, the output
    keeps the source's layout and loads in transformers, and no routing report is made."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dense = model_factory("llama")
    (tmp_path / "t.txt").write_text("def add(a, b):\n    return a + b\n" * 200)
    code, text = run(dense, tmp_path / "o", "--data", tmp_path / "t.txt", "--seq-len", "16",
                     "--full", "--steps", "3", "--lr", "1e-3")
    assert code == 0, text
    before, after = (load_file(d / "model.safetensors") for d in (dense, tmp_path / "o"))
    assert set(before) == set(after)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(moved) == len(before), set(before) - set(moved)
    AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    assert (tmp_path / "o" / "training" / "summary.json").is_file()
    assert not (tmp_path / "o" / "training" / "routing.json").exists()


def test_existing_output_and_bad_config(model_factory, tmp_path):
    dense = model_factory("llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "t.txt").write_text("x" * 1000)
    code, text = run(dense, tmp_path / "out", "--data", tmp_path / "t.txt")
    assert code == 1 and "already exists" in text and "--force" in text
    cfg = tmp_path / "train.yaml"
    cfg.write_text(f"model: {dense}\noutput: {tmp_path / 'o'}\ndata: [{tmp_path / 't.txt'}]\n"
                   "lr: -1\nbatch_sise: 4\nschedule: step\n")
    code, text = run("--config", cfg)
    assert code == 2 and str(cfg) in text and "3 config errors" in text
    assert "lr:" in text and "batch_sise: unknown field" in text and "schedule:" in text
    code, text = run(dense, tmp_path / "o", "--data", tmp_path / "t.txt", "--lr", "0")
    assert code == 2 and "lr (--lr)" in text
