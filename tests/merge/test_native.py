"""The compiled TIES kernel (moemerge/merge/native) gives the torch code's bytes, bit for bit,
and steps aside where it does not apply or cannot be built."""

import os

import pytest
import torch
from conftest import perturbed_copy, write_recipe

from moemerge.api import build
from moemerge.merge import dispatch, native
from moemerge.merge.draws import Draws


@pytest.fixture
def kernel():
    """Skips where the kernel cannot be built (no C compiler: the torch code runs there);
    compiled into the test session's cache, never the user's."""
    if native.library() is None:
        pytest.skip("no C compiler: the torch code runs everywhere")


requires_kernel = pytest.mark.usefixtures("kernel")


def torch_ties(monkeypatch, method: str = "ties", **kw):
    """The merge by the torch code alone."""
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        return dispatch.merge(method, **kw)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes, NaNs aside (both NaN at the same places; their payloads may differ)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a[~nan].view(ints), b[~nan].view(ints))


def experts(shape, n, dtype, seed=0):
    """A base and n models shaped like fine-tunes: small deltas, a third of them exactly zero
    (frozen entries), bf16-quantised (many tied magnitudes), a few -0.0 in the base."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g)
    base[base.abs() < 0.01] = -0.0
    models = [(base + torch.randn(shape, generator=g) * 0.01
               * (torch.rand(shape, generator=g) > 0.33)).to(dtype) for _ in range(n)]
    return base.to(dtype), models


SHAPES = [(7,), (576,), (300, 70), (600, 512)]  # the last is over 2^18 entries: row blocks


@requires_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_bytes_as_torch(monkeypatch, shape, n, dtype):
    base, models = experts(shape, n, dtype, seed=n)
    cases = [({}, None), ({"density": 0.3, "lambda": 0.7}, [1.0] * n),
             ({"density": [0.5, 1.0, 0.2, 0.9][:n], "normalize": False}, [0.3, 2.0, 1.5, 0.7][:n]),
             ({"density": 0.9, "zero_vote": "positive", "trim_rounding": "floor"}, None),
             ({"density": 1.0}, [2.0, 0.5, 1.0, 1.0][:n])]
    for params, weights in cases:
        for out in (torch.bfloat16, torch.float32):
            kw = dict(base=base, tensors=models, weights=weights, dtype=out, **params)
            fast = native.ties(base, models, weights, dtype=out, **_call(params))
            assert fast is not None
            assert same_bits(fast, dispatch.merge("ties", **kw)), (params, weights, out)
            assert same_bits(fast, torch_ties(monkeypatch, **kw)), (params, weights, out)


@requires_kernel
@pytest.mark.parametrize("method, params", [
    ("dare_ties", {"density": 0.5}), ("dare_ties", {"density": 0.6, "rescale": "l1"}),
    ("breadcrumbs_ties", {"density": 0.8, "gamma": 0.05}),
    ("della", {"density": 0.6, "epsilon": 0.1, "lambda": 0.9}),
    ("ties", {"density": 0.5, "trim_rounding": "sort", "zero_vote": "positive"})])
@pytest.mark.parametrize("shape", [(576,), (600, 512)])
@pytest.mark.parametrize("n", [2, 4])
def test_the_consensus_of_other_methods_gives_the_same_bytes(monkeypatch, method, params,
                                                             shape, n):
    """DARE-TIES, breadcrumbs-TIES, DELLA (and TIES where its own kernel steps aside) sparsify
    in torch and elect in the kernel: the bytes of the torch code, random masks included."""
    base, models = experts(shape, n, torch.bfloat16, seed=7)
    used, real = [], native.consensus
    monkeypatch.setattr(native, "consensus", lambda *a, **k: used.append(real(*a, **k)) or used[-1])
    for weights in (None, [0.3, 2.0, 1.5, 0.7][:n]):
        kw = dict(base=base, tensors=models, weights=weights, dtype=torch.bfloat16, **params)
        used.clear()
        fast = dispatch.merge(method, draws=Draws.of(1, "t"), **kw)
        assert used and all(out is not None for out in used)  # the kernel ran, every block
        slow = torch_ties(monkeypatch, method=method, draws=Draws.of(1, "t"), **kw)
        assert same_bits(fast, slow), (method, params, weights)


@requires_kernel
@pytest.mark.parametrize("cores", [2, 3])
def test_parts_side_by_side_give_the_same_bytes(monkeypatch, cores):
    """Each pass runs in one part of the tensor per core (histograms summed over the parts, the
    merge written part by part): the bytes of the torch code for any number of parts."""
    base, models = experts((600, 513), 4, torch.bfloat16, seed=3)
    monkeypatch.setattr(native, "PART", 1000)
    monkeypatch.setattr(native, "_cores", lambda: cores)
    seen = []
    real = native._in_parts
    def counted(count, run):
        results = real(count, run)
        seen.append(len(results))
        return results

    monkeypatch.setattr(native, "_in_parts", counted)
    params = {"density": [0.5, 0.2, 0.9, 0.05], "lambda": 0.8}
    fast = native.ties(base, models, [1.0, 0.5, 2.0, 1.0], dtype=torch.bfloat16,
                       **_call(params))
    assert set(seen) == {cores}
    assert same_bits(fast, torch_ties(monkeypatch, base=base, tensors=models,
                                      weights=[1.0, 0.5, 2.0, 1.0], dtype=torch.bfloat16,
                                      **params))


def _call(params: dict) -> dict:
    """The registry's parameters as methods.ties takes them."""
    call = {"density": 0.7, "lam": 1.0} | {k: v for k, v in params.items() if k != "lambda"}
    return call | ({"lam": params["lambda"]} if "lambda" in params else {})


@requires_kernel
def test_nan_and_inf_go_where_torch_puts_them(monkeypatch):
    base, models = experts((300, 70), 3, torch.bfloat16)
    models[1][5, 5], models[2][7, 7], base[9, 9] = float("nan"), float("inf"), float("-inf")
    kw = dict(base=base, tensors=models, dtype=torch.bfloat16, density=0.5)
    fast, slow = dispatch.merge("ties", **kw), torch_ties(monkeypatch, **kw)
    assert fast.isnan().any() and same_bits(fast, slow)


@requires_kernel
def test_a_different_merge_is_seen(monkeypatch):
    """The comparison can fail: the kernel's bytes against torch's for another λ, another
    vote rule, or one input entry one bf16 step apart (all models agreeing there) differ."""
    base, models = experts((600, 512), 3, torch.bfloat16)
    fast = dispatch.merge("ties", base=base, tensors=models, dtype=torch.float32, density=0.3)
    for other in ({"lambda": 0.999}, {"zero_vote": "positive"}):
        assert not same_bits(fast, torch_ties(monkeypatch, base=base, tensors=models,
                                              dtype=torch.float32, density=0.3, **other))
    nudged = [m.clone() for m in models]
    at = int((models[0].float() - base.float()).abs().argmax())  # kept at any density
    for m in nudged:
        m.view(-1)[at] = models[0].view(-1)[at]
    same = torch_ties(monkeypatch, base=base, tensors=nudged, dtype=torch.float32, density=0.3)
    nudged[1].view(torch.int16).view(-1)[at] += 1
    assert not same_bits(same, torch_ties(monkeypatch, base=base, tensors=nudged,
                                          dtype=torch.float32, density=0.3))


def test_steps_aside_where_it_does_not_apply():
    base, models = experts((300, 70), 5, torch.bfloat16)
    kw = {"density": 0.7, "lam": 1.0}
    assert native.ties(base, models, None, dtype=torch.bfloat16, **kw) is None  # 5 models
    assert native.ties(base.half(), [m.half() for m in models[:2]], None,
                       dtype=torch.float16, **kw) is None
    assert native.ties(base, models[:2], None, dtype=torch.bfloat16, trim_rounding="sort",
                       **kw) is None
    assert native.ties(base, models[:2], None, dtype=torch.bfloat16, consensus="count",
                       **kw) is None
    assert native.ties(base, [models[0].float(), models[1]], None, dtype=torch.bfloat16,
                       **kw) is None  # mixed dtypes


@pytest.mark.parametrize("env", [{"MOEMERGE_NATIVE": "0"}, {"CC": "/bin/false"},
                                 {"CC": "/nonexistent/cc"}])
def test_no_kernel_and_the_torch_code_runs(monkeypatch, tmp_path, env):
    """Switched off, or a compiler that fails or is missing: no library, and merges run as
    before (the cache holds no half-written library)."""
    monkeypatch.setenv("MOEMERGE_CACHE", str(tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    native.library.cache_clear()
    try:
        assert native.library() is None
        base, models = experts((300, 70), 2, torch.bfloat16)
        merged = dispatch.merge("ties", base=base, tensors=models, dtype=torch.bfloat16)
        assert merged.shape == base.shape and merged.dtype == torch.bfloat16
    finally:
        native.library.cache_clear()
    assert not any((tmp_path / "native").glob("*")) if (tmp_path / "native").exists() else True


@requires_kernel
def test_compiled_once_per_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEMERGE_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        (built,) = (tmp_path / "native").glob("merge-*.so")
        stamp = built.stat().st_mtime_ns
        native.library.cache_clear()
        assert native.library() is not None
        assert built.stat().st_mtime_ns == stamp
        assert sorted(os.listdir(built.parent)) == sorted([built.name, built.stem + ".sha256"])
    finally:
        native.library.cache_clear()


@requires_kernel
def test_a_build_writes_the_same_bytes_either_way(model_factory, tmp_path, monkeypatch):
    """A bf16 TIES build through the whole pipeline (tied embeddings, every role), with the
    kernel and with the torch code: the same safetensors bytes."""
    base = model_factory("llama", dtype=torch.bfloat16, tie_word_embeddings=True)
    models = [perturbed_copy(base, tmp_path / f"m{i}", scale=0.05, seed=i) for i in range(3)]
    recipe = write_recipe(tmp_path / "ties.yaml", f"kind: merge\nbase_model: {base}\n"
                          f"models: [{', '.join(map(str, models))}]\n"
                          "merge: {method: ties, density: 0.4, lambda: 0.8}\n")
    build(recipe, tmp_path / "kernel", progress=False)
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        build(recipe, tmp_path / "torch", progress=False)
    written = sorted(p.name for p in (tmp_path / "kernel").glob("*.safetensors"))
    assert written and all((tmp_path / "kernel" / n).read_bytes()
                           == (tmp_path / "torch" / n).read_bytes() for n in written)
