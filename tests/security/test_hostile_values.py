"""No traceback from a hostile number or type: an integer of 5000 digits wherever numbers are
read (Python refuses to convert it: a bare ValueError), values out of range, non-finite or of
the wrong type in config.json, recipes, mergekit configs and data. Each is a clean exit 1 or 2
naming the file and the key; config values an output copies are checked before the build."""

import json
import shutil

import pytest
from conftest import write_recipe
from typer.testing import CliRunner

from moemerge.cli import app

BIG = "1" * 5000


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"{type(result.exception).__name__}: {result.exception}")
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture
def work(model_factory, tmp_path, monkeypatch):
    shutil.copytree(model_factory("llama"), tmp_path / "base")
    (tmp_path / "t.txt").write_text("def add(a, b):\n    return a + b\n\n" * 40)
    monkeypatch.chdir(tmp_path)
    return tmp_path


RECIPE_FIELDS = [
    ("seed", f"kind: merge\nmodels: [base, base]\nseed: {BIG}\n"),
    ("output.max_shard_size", f"kind: merge\nmodels: [base, base]\noutput: {{max_shard_size: "
                              f"{BIG}}}\n"),
    ("merge.overrides[0].layers[0]", "kind: merge\nmodels: [base, base]\nmerge: {method: "
                                     f"average, overrides: [{{layers: [{BIG}]}}]}}\n"),
    ("calibration.max_tokens", "kind: moe\nbase_model: base\nexperts: [base, base]\nrouter: "
                               f"{{init: calibrate}}\ncalibration: {{data: [t.txt], max_tokens: "
                               f"{BIG}}}\n"),
    ("calibration.seq_len", "kind: moe\nbase_model: base\nexperts: [base, base]\nrouter: "
                            f"{{init: calibrate}}\ncalibration: {{data: [t.txt], seq_len: "
                            f"{2**63}}}\n"),
    ("merge.lambda", "kind: merge\nbase_model: base\nmodels: [base, base]\nmerge: {method: "
                     "task_arithmetic, lambda: 1e38}\n"),
    ("merge.lambda", "kind: merge\nbase_model: base\nmodels: [base, base]\nmerge: {method: "
                     "task_arithmetic, lambda: true}\n"),
    ("merge.overrides.0.lambda", "kind: merge\nbase_model: base\nmodels: [base, base]\nmerge: "
                                  "{method: ties, overrides: [{lambda: [0.5, true]}]}\n"),
]


@pytest.mark.parametrize("key, text", RECIPE_FIELDS,
                         ids=[f"{k}-{i}" for i, (k, _) in enumerate(RECIPE_FIELDS)])
def test_recipe_numbers_out_of_range(work, key, text):
    write_recipe(work / "r.yaml", text)
    for argv in (["validate", "r.yaml"], ["build", "r.yaml", "out"]):
        code, out = cli(*argv)
        assert code == 2 and "r.yaml" in out and key in out, (argv, out)
    assert not (work / "out").exists()


CONFIG_VALUES = [  # (key, raw JSON value, words of the error)
    ("num_hidden_layers", BIG, "5000 digits"),
    ("eos_token_id", BIG, "5000 digits"),
    ("eos_token_id", str(10**30), "token id"),
    ("eos_token_id", "[1, -3]", "token id"),
    ("bos_token_id", "true", "token id"),
    ("rope_theta", "-5", "positive number"),
    ("rope_theta", '"1e4"', "positive number"),
    ("rms_norm_eps", "1e400", "finite"),
    ("rope_scaling", '{"factor": NaN}', "finite"),
    ("rope_scaling", "[1, 2]", "object"),
    ("torch_dtype", '"float8_e4m3fnuz_x"', "torch dtype"),
    ("architectures", json.dumps(["LlamaForCausalLM"] * 1000), "class names"),
    ("tie_word_embeddings", '"yes"', "true, false"),
    ("max_position_embeddings", BIG, "5000 digits"),
]


@pytest.mark.parametrize("key, raw, words", CONFIG_VALUES,
                         ids=[f"{k}={r[:10]}" for k, r, _ in CONFIG_VALUES])
def test_config_values_are_checked_before_they_are_copied(work, key, raw, words):
    shutil.copytree(work / "base", work / "m")
    config = json.loads((work / "m" / "config.json").read_text())
    config[key] = "@@"
    (work / "m" / "config.json").write_text(json.dumps(config).replace('"@@"', raw))
    write_recipe(work / "r.yaml", "kind: merge\nmodels: [base, m]\n")
    code, out = cli("build", "r.yaml", "out")
    assert code == 1 and "m/config.json" in out and key in out and words in out, out
    assert not (work / "out").exists()


def test_index_and_jsonl_numbers(work):
    index = {"metadata": {"total_size": "@@"}, "weight_map": {}}
    (work / "base" / "model.safetensors.index.json").write_text(
        json.dumps(index).replace('"@@"', BIG))
    write_recipe(work / "r.yaml", "kind: merge\nmodels: [base, base]\n")
    code, out = cli("build", "r.yaml", "out")
    assert code == 1 and "index.json" in out and "metadata.total_size" in out, out
    (work / "base" / "model.safetensors.index.json").write_text('{"metadata": {}}')
    code, out = cli("build", "r.yaml", "out")
    assert code == 1 and "index.json" in out and "no weight_map" in out, out
    (work / "base" / "model.safetensors.index.json").unlink()
    (work / "d.jsonl").write_text('{"text": "hello there"}\n{"text": "x", "n": ' + BIG + "}\n")
    for argv in (["inspect", "routing", "base", "--data", "d.jsonl"],
                 ["finetune", "base", "out", "--data", "d.jsonl", "-q"]):
        code, out = cli(*argv)
        assert code == 2 and "d.jsonl:2" in out and "n: an integer of 5000 digits" in out, out


@pytest.mark.parametrize("value", [".inf", ".nan", "1e400", "two", "true", "0", BIG])
def test_mergekit_moe_experts_per_token(work, value):
    write_recipe(work / "mk.yml", f"base_model: base\ngate_mode: random\nexperts_per_token: "
                 f"{value}\nexperts:\n  - source_model: base\n  - source_model: base\n")
    code, out = cli("import-mergekit", "mk.yml")
    assert code == 2 and "mk.yml" in out and "experts_per_token" in out, out


def test_mergekit_numbers(work):
    write_recipe(work / "mk.yml", f"merge_method: linear\nmodels:\n  - model: base\n"
                 f"    parameters: {{weight: {BIG}}}\n")
    code, out = cli("import-mergekit", "mk.yml")
    assert code == 2 and "models[0].parameters.weight" in out, out
    big = "1" + "0" * 400  # an int, but not a float
    write_recipe(work / "mk.yml", f"merge_method: slerp\nbase_model: base\nmodels:\n"
                 f"  - model: base\n  - model: base\nparameters: {{t: [0, {big}]}}\n")
    code, out = cli("import-mergekit", "mk.yml")
    assert code == 2 and "too large" in out, out


def test_sequence_routed_config_with_an_int_expert_list(work):
    write_recipe(work / "s.yaml", "kind: moe\nassembly: seq_routed\nbase_model: base\n"
                 "experts: [base, base]\nexperts_per_sequence: 1\n")
    assert cli("build", "s.yaml", "seq", "--verify", "structure", "-q")[0] == 0
    config = json.loads((work / "seq" / "config.json").read_text())
    for key, value in (("experts", 3), ("experts", [1, 2]), ("expert_names", 7)):
        (work / "seq" / "config.json").write_text(json.dumps({**config, key: value}))
        for k in ([], ["-k", "1"]):
            code, out = cli("route", "seq", "t.txt", *k)
            assert code == 1 and "seq/config.json" in out and key in out, (key, value, out)


def test_negative_tune_lambdas(work):
    write_recipe(work / "r.yaml", "kind: merge\nbase_model: base\nmodels: [base, base]\n"
                 "merge: {method: task_arithmetic}\n")
    code, out = cli("build", "r.yaml", "out", "--tune-on", "t.txt", "--tune-lambdas", "-1,0.5")
    assert code == 2 and "--tune-lambdas" in out and ">= 0" in out, out
