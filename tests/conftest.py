"""Shared fixtures: tiny random models of every supported family, written to tmp dirs."""

from __future__ import annotations

import os

# the suite downloads nothing: a hub lookup fails at once instead of waiting out the network's
# timeouts (23 s for one dataset id). huggingface_hub and datasets read this when imported, so
# it is set before anything imports them.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import shutil  # noqa: E402
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

torch.set_num_threads(2)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# sources of token-routed builds only (post-norms, multipliers: architectures/dense.yaml)
TOKEN_ROUTED_FAMILIES = (*FAMILIES, "olmo2", "granite")


def needs_class(name: str):
    """A skip mark for tests of a transformers class the installed version lacks (FlexOlmo
    arrived in transformers 4.57; the floor is 4.56.2)."""
    import transformers

    return pytest.mark.skipif(not hasattr(transformers, name),
                              reason=f"transformers {transformers.__version__} has no {name}")


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def snapshot(root: Path) -> dict[Path, bytes]:
    """Every file under `root` with its bytes: equal before and after means nothing changed."""
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def perturbed_copy(src: Path, dst: Path, *, scale: float, seed: int, only: str = "") -> Path:
    """A copy of checkpoint `src` with N(0, scale²) noise added to tensors whose name contains
    `only` (all when empty): a stand-in for a fine-tuned expert branched from `src`."""
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if only in name:
                tensors[name] = t + scale * torch.randn(t.shape, generator=gen).to(t.dtype)
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


FRESH = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
out = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=4, do_sample=False,
                     pad_token_id=0)
print(out.shape[1], getattr(model.config, "assembly", model.config.model_type))
"""


def generate_in_fresh_process(model_dir: Path, scratch: Path) -> list[str]:
    """Load `model_dir` with its shipped code in a new offline Python (empty module cache),
    generate 4 tokens; returns [sequence length, assembly] as printed."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(scratch / "modules"),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", FRESH, str(model_dir)], env=env,
                          capture_output=True, text=True, cwd=scratch, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


TEXT = "def add(a, b):\n    return a + b\n\nThe sum of two numbers. Q: What is 2 + 3? A: 5.\n"
VOCAB = 300  # the tokenizer's 260 specials and bytes, a few merges, some unused ids


@pytest.fixture(scope="session")
def tokenizer():
    from moemerge.toy.tokenizer import train_tokenizer

    return train_tokenizer([TEXT * 20], vocab_size=VOCAB)


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory, tokenizer):
    """make(family, **kw) -> path of a tiny random model with a tokenizer, cached per args."""
    from moemerge.toy.experts import make_random_model

    root = tmp_path_factory.mktemp("models")
    made: dict[tuple, Path] = {}

    def make(family: str = "llama", **kwargs) -> Path:
        key = (family, tuple(sorted(kwargs.items())))
        if key not in made:
            kwargs.setdefault("vocab", VOCAB)
            made[key] = make_random_model(family, root / f"{family}-{len(made)}",
                                          tokenizer=tokenizer, **kwargs)
        return made[key]

    return make


# the user's own cache, as the suite found it: never read or written by the tests
USERS_CACHE = os.environ.get("MOEMERGE_CACHE")


@pytest.fixture(scope="session", autouse=True)
def moemerge_cache(tmp_path_factory):
    """moemerge's cache (the toy experts, the compiled kernel) while the tests run: the suite's
    own, never the user's $MOEMERGE_CACHE or ~/.cache/moemerge. $MOEMERGE_TEST_CACHE when it
    is set (CI keeps one between its runs), else a temporary directory of this session."""
    shared = os.environ.get("MOEMERGE_TEST_CACHE")
    if shared:
        Path(shared).mkdir(mode=0o700, parents=True, exist_ok=True)
    root = Path(shared) if shared else tmp_path_factory.mktemp("moemerge-cache")
    os.environ["MOEMERGE_CACHE"] = str(root)  # subprocesses of the tests inherit it
    yield root
    if USERS_CACHE is None:
        del os.environ["MOEMERGE_CACHE"]
    else:
        os.environ["MOEMERGE_CACHE"] = USERS_CACHE


def llama_cpp_note(expected: bool = True):
    """moemerge's warning that llama.cpp computes another model than transformers for the
    output's layout (plan/shared_expert.downstream_notes: qwen2_moe and deepseek with top-k of
    more experts, deepseek with top-1): asserted where the test builds such an output, nothing
    expected elsewhere."""
    import contextlib

    return (pytest.warns(UserWarning, match=r"llama\.cpp") if expected
            else contextlib.nullcontext())


def llama_cpp_differs(config: dict) -> bool:
    """Whether an MoE of this config.json gets that note: qwen2_moe and deepseek route top-k of
    more experts without llama.cpp renormalising it, and deepseek scales a top-1 expert by its
    routing weight."""
    kind, k = config.get("model_type"), config.get("num_experts_per_tok")
    n = config.get("num_experts") or config.get("n_routed_experts")
    return kind in ("qwen2_moe", "deepseek") and (k < n or (kind == "deepseek" and k == 1))


def build_noting(recipe, out, **options):
    """`moemerge.api.build` with its warnings collected (the `warn` callback) and checked: the
    llama.cpp note where the output's layout has it (llama_cpp_differs), none elsewhere. For
    the helpers that build outputs of any layout."""
    import json

    from moemerge.api import build

    notes: list[str] = []
    result = build(recipe, out, warn=notes.append, **options)
    config = json.loads((Path(out) / "config.json").read_text())
    if llama_cpp_differs(config):
        assert notes and all("llama.cpp" in note for note in notes), notes
    else:
        assert not notes, notes
    return result


@pytest.fixture(scope="session")
def tiny_toy(moemerge_cache):
    """The TINY toy experts, made once per cache and shared by every test that needs them."""
    from moemerge.toy import TINY, cached_toy_experts

    return cached_toy_experts(TINY, progress=False)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory, model_factory):
    """A token-routed MoE (Mixtral, 2 experts, random router) built from tiny random models,
    for tests that need one fast: hardening and fault tests."""
    from moemerge.api import build

    root = tmp_path_factory.mktemp("tiny_moe")
    base = model_factory("llama")
    experts = [perturbed_copy(base, root / f"e{i}", scale=0.02, seed=i, only="mlp")
               for i in range(2)]
    recipe = write_recipe(root / "recipe.yaml", f"kind: moe\nbase_model: {base}\nexperts: "
                          f"[{experts[0]}, {experts[1]}]\nrouter: {{init: random}}\n")
    build(recipe, root / "moe", progress=False, verify="structure")
    return root / "moe"


@pytest.fixture(scope="session")
def train_text(tmp_path_factory):
    """A small .txt training file (enough for a few blocks of 16 tokens)."""
    path = tmp_path_factory.mktemp("text") / "code.txt"
    path.write_text(TEXT * 40)
    return path


@pytest.fixture
def torch_code(monkeypatch):
    """The torch merges themselves, the compiled kernel (merge/native) set aside: the tests of
    the torch code's row blocks; tests/merge/test_native.py checks the kernel's bytes against
    them."""
    from moemerge.merge import native

    monkeypatch.setattr(native, "library", lambda: None)
