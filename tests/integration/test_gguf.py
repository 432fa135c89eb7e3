"""`build --gguf`: a clear error before any work when llama.cpp's converter is missing, and a
.gguf that exists only whole. Most tests fake the converter (a script with its command line);
the real one needs a llama.cpp checkout ($LLAMA_CPP_DIR) and sentencepiece, which .ci/run
unpacks from the llama-cpp-python sdist on PyPI (the converter is Python; nothing is compiled),
so a build's and a shrunk model's conversions run in CI; benchmarks/downstream/run.py converts
every layout and compares llama.cpp's logits with transformers'."""

import pytest
from conftest import TEXT, write_recipe
from typer.testing import CliRunner

from moemerge.cli import app

runner = CliRunner()

FAKE = """import sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--outfile") + 1])
out.write_bytes(b"GGUF" + b"\\0" * 64)  # written in part either way
if "--outtype" in args and args[args.index("--outtype") + 1] == "q8_0":
    print("conversion failed: unsupported tensor", file=sys.stderr)
    sys.exit(3)
"""


@pytest.fixture
def no_converter(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path"))


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def recipe(tmp_path, base, extra="") -> str:
    return write_recipe(tmp_path / "recipe.yaml",
                        f"kind: moe\nbase_model: {base}\nexperts: [{base}, {base}]\n{extra}")


def test_missing_converter_exits_2_before_building(model_factory, tmp_path, no_converter):
    code, text = run("build", recipe(tmp_path, model_factory("llama")), tmp_path / "out",
                     "--gguf", "f32")
    assert code == 2
    assert "convert_hf_to_gguf.py" in text and "--llama-cpp" in text
    assert "LLAMA_CPP_DIR" in text and "moemerge[gguf]" in text
    assert not (tmp_path / "out").exists()


def test_directory_without_converter_is_named(model_factory, tmp_path, no_converter):
    (tmp_path / "llama.cpp").mkdir()
    code, text = run("build", recipe(tmp_path, model_factory("llama")), tmp_path / "out",
                     "--gguf", "bf16", "--llama-cpp", tmp_path / "llama.cpp")
    assert code == 2 and "--llama-cpp" in text and str(tmp_path / "llama.cpp") in text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, args, message", [
    ("", ["--gguf", "q4_k"], "--gguf: must be one of f32, f16, bf16, q8_0"),
    ("assembly: seq_routed\n", ["--gguf", "f32"], "seq_routed output runs moemerge's own"),
])
def test_unsupported_requests_exit_2(model_factory, tmp_path, no_converter, extra, args,
                                     message):
    code, text = run("build", recipe(tmp_path, model_factory("llama"), extra), tmp_path / "out",
                     *args)
    assert code == 2 and message in " ".join(text.split())
    assert not (tmp_path / "out").exists()


def test_gguf_is_renamed_only_when_the_converter_succeeds(model_factory, tmp_path, monkeypatch):
    checkout = tmp_path / "llama.cpp"
    checkout.mkdir()
    (checkout / "convert_hf_to_gguf.py").write_text(FAKE)
    monkeypatch.setenv("LLAMA_CPP_DIR", str(checkout))
    base = model_factory("llama")
    code, text = run("build", recipe(tmp_path, base), tmp_path / "out", "--gguf", "bf16")
    assert code == 0, text
    assert (tmp_path / "out" / "model-bf16.gguf").read_bytes().startswith(b"GGUF")
    assert not list((tmp_path / "out").glob("*.partial"))

    code, text = run("build", recipe(tmp_path, base), tmp_path / "out2", "--gguf", "q8_0")
    assert code == 1 and "unsupported tensor" in text and "exit code 3" in text
    out2 = tmp_path / "out2"
    assert (out2 / "config.json").is_file()  # the safetensors output stays, whole
    assert not list(out2.glob("*.gguf*"))  # and no half-written GGUF, under any name


def _real_converter() -> bool:
    import importlib.util
    import os

    return bool(os.environ.get("LLAMA_CPP_DIR")) and importlib.util.find_spec(
        "sentencepiece") is not None


needs_converter = pytest.mark.skipif(
    not _real_converter(), reason="needs llama.cpp's converter ($LLAMA_CPP_DIR) and "
    "sentencepiece: .ci/run unpacks it from the llama-cpp-python sdist")


def sentencepiece_moe(root, count=3):
    """A Mixtral built from a random Llama with a SentencePiece vocabulary (the converter
    refuses BPE pre-tokenizers it does not know) and `count` perturbed experts."""
    import shutil

    import sentencepiece
    from conftest import perturbed_copy

    from moemerge.toy.corpora import domain_text
    from moemerge.toy.experts import make_random_model

    (root / "text.txt").write_text(domain_text("prose", 50_000))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "text.txt"),
                                             model_prefix=str(root / "sp"), vocab_size=256)
    base = make_random_model("llama", root / "base", vocab=256)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (base / name).unlink(missing_ok=True)
    shutil.copy(root / "sp.model", base / "tokenizer.model")
    experts = [perturbed_copy(base, root / f"e{i}", scale=0.02, seed=i) for i in range(count)]
    return write_recipe(root / "recipe.yaml", f"kind: moe\nbase_model: {base}\n"
                        f"experts: [{', '.join(map(str, experts))}]\n")


def gguf_reader(file):
    """gguf-py's GGUFReader from the llama.cpp checkout in $LLAMA_CPP_DIR, reading `file`."""
    import os
    import sys
    from pathlib import Path

    root = Path(os.environ["LLAMA_CPP_DIR"])
    gguf_py = next(p for p in (root / "gguf-py", root / "vendor" / "llama.cpp" / "gguf-py")
                   if p.is_dir())
    sys.path.insert(0, str(gguf_py))
    from gguf import GGUFReader

    return GGUFReader(file)


@needs_converter
def test_real_conversion_writes_a_mixtral_gguf(tmp_path):
    code, text = run("build", sentencepiece_moe(tmp_path), tmp_path / "out", "--gguf", "f32")
    assert code == 0, text
    reader = gguf_reader(tmp_path / "out" / "model-f32.gguf")
    assert int(reader.fields["llama.expert_count"].parts[-1][0]) == 3
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    assert shapes["blk.0.ffn_gate_exps.weight"] == (32, 64, 3)  # ggml order: hidden, ffn, E


@needs_converter
def test_real_conversion_writes_a_deepseek_gguf_with_its_shared_expert(tmp_path):
    """A DeepSeek-MoE (a Llama base with `shared_expert: base`) through llama.cpp's converter:
    its `deepseek` architecture, 3 routed experts and 1 shared one, the shared FFN the base's."""
    import numpy as np
    from safetensors.torch import load_file

    recipe = sentencepiece_moe(tmp_path)
    recipe.write_text(recipe.read_text() + "shared_expert: base\n")
    code, text = run("build", recipe, tmp_path / "out", "--gguf", "f32")
    assert code == 0, text
    reader = gguf_reader(tmp_path / "out" / "model-f32.gguf")
    assert reader.fields["general.architecture"].contents() == "deepseek"
    assert int(reader.fields["deepseek.expert_count"].parts[-1][0]) == 3
    assert int(reader.fields["deepseek.expert_shared_count"].parts[-1][0]) == 1
    found = {t.name: np.asarray(t.data) for t in reader.tensors}
    base = load_file(tmp_path / "base" / "model.safetensors")
    assert np.array_equal(found["blk.1.ffn_up_shexp.weight"],
                          base["model.layers.1.mlp.up_proj.weight"].numpy())


@needs_converter
def test_a_shrunk_moe_converts_with_its_experts_intact(tmp_path):
    """`moemerge shrink` 4 -> 2 experts, then llama.cpp's converter: the GGUF has 2 experts,
    and every kept expert's weights and each router are the shrunk checkpoint's, bit for bit
    in f32 (no repair, so the router rows are the kept experts' own)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from moemerge.api import build
    from moemerge.finish.gguf import find_converter, write_gguf

    moe = tmp_path / "moe"
    build(sentencepiece_moe(tmp_path, count=4), moe, progress=False, verify="structure")
    (tmp_path / "calib.txt").write_text(TEXT * 40)
    code, text = run("shrink", moe, tmp_path / "out", "--experts", "2", "--method", "prune",
                     "--no-repair",
                     "--calibration", tmp_path / "calib.txt", "--seq-len", "32")
    assert code == 0, text
    shrunk = {n: t for f in (tmp_path / "out").glob("*.safetensors") for n, t in
              load_file(f).items()}
    reader = gguf_reader(write_gguf(tmp_path / "out", "f32", find_converter(None)))
    assert int(reader.fields["llama.expert_count"].parts[-1][0]) == 2
    found = {t.name: np.asarray(t.data) for t in reader.tensors}
    name = "model.layers.{}.block_sparse_moe.{}"
    for layer in range(2):
        gate = torch.stack([shrunk[name.format(layer, f"experts.{e}.w1.weight")]
                            for e in range(2)])  # [E, I, H], as ggml stores [H, I, E]
        assert np.array_equal(found[f"blk.{layer}.ffn_gate_exps.weight"], gate.numpy())
        assert np.array_equal(found[f"blk.{layer}.ffn_gate_inp.weight"],
                              shrunk[name.format(layer, "gate.weight")].numpy())


@needs_converter
def test_a_merge_of_moe_fine_tunes_in_both_forms_converts(tmp_path):
    """Two Mixtral fine-tunes, one stored fused (transformers 5's stacks, as mergekit 0.1.5
    writes), merged by `kind: merge` with --gguf: the GGUF's expert stacks are the mean of
    the inputs' experts, bit for bit in f32."""
    import numpy as np
    import torch

    from moemerge.api import build
    from moemerge.io.reader import CheckpointReader

    recipe = sentencepiece_moe(tmp_path, count=2)
    text = recipe.read_text()
    build(recipe, tmp_path / "a", progress=False, verify="structure")
    recipe.write_text(text + "seed: 1\nrouter: {init: random, std: 0.5}\n"
                      "output: {experts: fused}\n")
    build(recipe, tmp_path / "b", progress=False, verify="structure")
    merge = write_recipe(tmp_path / "merge.yaml", f"kind: merge\nmodels: [{tmp_path / 'a'}, "
                         f"{tmp_path / 'b'}]\nmerge: {{method: average}}\n")
    code, out = run("build", merge, tmp_path / "out", "--gguf", "f32")
    assert code == 0, out
    reader = gguf_reader(tmp_path / "out" / "model-f32.gguf")
    found = {t.name: np.asarray(t.data) for t in reader.tensors}
    with CheckpointReader(tmp_path / "a") as a, CheckpointReader(tmp_path / "b") as b:
        assert (a.form, b.form) == ("classic", "fused")
        name = "model.layers.1.block_sparse_moe.{}"
        router = (a.read(name.format("gate.weight")) + b.read(name.format("gate.weight"))) / 2
        assert not torch.equal(a.read(name.format("gate.weight")),
                               b.read(name.format("gate.weight")))
        assert np.array_equal(found["blk.1.ffn_gate_inp.weight"], router.numpy())
        up = torch.stack([(a.read(name.format(f"experts.{e}.w3.weight"))
                           + b.read(name.format(f"experts.{e}.w3.weight"))) / 2
                          for e in range(2)])
        assert np.array_equal(found["blk.1.ffn_up_exps.weight"], up.numpy())


def test_a_layout_llama_cpp_cannot_convert_is_refused_before_any_tensor_is_read(
        model_factory, tmp_path, no_converter, monkeypatch):
    """FlexOlmo (from OLMo-2 sources): llama.cpp's converter has no FlexOlmoForCausalLM. The
    refusal names the layouts that convert, comes before the converter is looked for, and
    reads headers only."""
    from moemerge.architectures.tables import moe_layouts
    from moemerge.io.reader import CheckpointReader

    def no_tensor(self, name):
        raise AssertionError(f"tensor {name} read")

    monkeypatch.setattr(CheckpointReader, "read", no_tensor)
    code, text = run("build", recipe(tmp_path, model_factory("olmo2"),
                                     "experts_per_token: 1\n"), tmp_path / "out", "--gguf", "f16")
    text = " ".join(text.split())
    assert code == 2 and "does not know the flex_olmo layout (FlexOlmoForCausalLM)" in text, text
    converts = [lay.name for lay in moe_layouts().values()
                if lay.llama_cpp_converts and lay.builds]
    assert converts and "flex_olmo" not in converts
    assert all(f"{name} (" in text for name in converts), text
    assert not (tmp_path / "out").exists()


def test_more_experts_than_llama_cpp_loads_is_said():
    """llama.cpp asserts n_expert <= LLAMA_MAX_EXPERTS (1024) when it loads a GGUF: `build
    --gguf` refuses such a config before any work; `extend` notes it (too_many_experts)."""
    from moemerge.errors import RecipeError
    from moemerge.finish.gguf import check_layout_converts, too_many_experts

    config = {"architectures": ["MixtralForCausalLM"], "num_local_experts": 1024}
    assert too_many_experts(config) is None
    check_layout_converts(config)
    for key in ("num_local_experts", "num_experts"):  # Mixtral's key, Qwen's
        grown = {"architectures": ["MixtralForCausalLM"], key: 1025}
        assert "1025 experts per layer: llama.cpp loads at most 1024" in too_many_experts(grown)
        with pytest.raises(RecipeError, match="--gguf: 1025 experts per layer"):
            check_layout_converts(grown)
