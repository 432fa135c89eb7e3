"""Bad finetune input: a clear message and the documented exit code (1 runtime, 2 usage)."""

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
    assert code == 1 and "is not an MoE" in text and "nothing of an MoE to train" in text
    code, text = run(dense, tmp_path / "o", *common, "--router-only", "--full")
    assert code == 2 and "only one of" in text
    code, text = run(dense, tmp_path / "o", *common, "--fsdp")  # accepted: one process, unsharded
    assert code == 1 and "is not an MoE" in text


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
