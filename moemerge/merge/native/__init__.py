"""TIES as a compiled kernel: three streaming passes over the inputs instead of eager torch's
dozen, with the same bytes out; the sign consensus of the other TIES-family methods; and the
counter-based random drop of DARE and DELLA (draws.c, merge/draws.py's hash).

Eager TIES makes every intermediate a tensor (the float32 task vectors, their magnitudes, keys,
masks, the vote, the agreement, the weighted sums): at the Llama-3.2-1B shape with 4 experts it
runs ~11× the I/O floor, compute-bound. ties.c does, per entry, the same float32 operations in
the same order (so the bytes are identical; tests/merge/test_native.py compares them bit for
bit), streaming the bf16 / float32 inputs three times: two histograms that give each model's
trim threshold exactly, then the merge; each pass in one contiguous part of the tensor per core,
side by side.
DARE-TIES, breadcrumbs-TIES and DELLA sparsify in torch (their random masks, drawn by `keep`,
and bands) and hand their float32 task vectors to the same consensus (`consensus`, one pass
where the torch code makes ten).

The library is compiled on first use with the system's C compiler ($CC, else cc; resolved to an
absolute path and run with a time limit, moemerge.external) into $MOEMERGE_CACHE/native, a
directory of the user's own with mode 0700 (moemerge.cache refuses one that others could
write): one file per source, compiler and CPU, renamed into place from a private temporary,
its sha256 recorded beside it. It is loaded with ctypes (which releases the GIL while it runs,
so merge workers run it side by side) from the very file whose digest was checked; a mismatch
compiles it again. Where there is no compiler, MOEMERGE_NATIVE=0, the build fails or the cache
is not the user's own (the last two said in a Note), `ties` returns None and the caller runs
the torch code; so do the cases the kernel does not cover (more than 4 models, a
dtype other than bf16 / float32, a GPU tensor, `trim_rounding: sort`, `consensus: count`).
`keep` covers any model count (each model's drop is its own).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from moemerge import buffers
from moemerge.cache import private_dir
from moemerge.errors import CacheError, Note, ToolError
from moemerge.external import last_lines, resolve_program, run_tool
from moemerge.merge.blocks import select_bins
from moemerge.merge.methods import weights_of
from moemerge.merge.primitives import check_density, keep_count, per_model

SOURCES = tuple(Path(__file__).with_name(name) for name in ("ties.c", "draws.c"))
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared",
         "-std=c11")
MAX_MODELS = 4  # torch sums a stack of at most 4 over its first axis from 0 in order
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
BUCKETS, LOW = 1 << 16, 1 << 15  # the top 16 and the low 15 bits of a non-negative float32
PART = 1 << 18  # entries: a tensor is cut into parts, one per core, of at least this many

_P = ctypes.c_void_p
_SIGNATURES = {
    "ties_histogram": (_P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int, _P),
    "ties_histogram_low": (_P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int, _P, _P),
    "ties_merge": (_P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int, _P, _P, ctypes.c_float,
                   ctypes.c_int, ctypes.c_int, _P, ctypes.c_int),
    "ties_consensus": (_P, _P, ctypes.c_int, ctypes.c_int64, ctypes.c_int, _P, ctypes.c_float,
                       ctypes.c_int, ctypes.c_int, _P, ctypes.c_int),
    "draws_keep": (_P, _P, ctypes.c_float, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint32,
                   ctypes.c_uint32, _P),
}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (MOEMERGE_NATIVE=0, no compiler; a failed build or an
    untrusted cache, each said in a Note)."""
    if os.environ.get("MOEMERGE_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc")
    if compiler is None:
        return None
    try:
        lib = _loaded(resolve_program(compiler, "the C compiler ($CC, else cc)"))
    except (CacheError, ToolError, OSError) as exc:
        warnings.warn(f"{exc}. Merging with the torch code instead of the compiled kernel "
                      "(the same bytes, slower)", Note, stacklevel=2)
        return None
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = ctypes.c_int
    return lib


VERSION_TIMEOUT, COMPILE_TIMEOUT = 30, 300  # s; compiling takes ~11 s on 2 cores


def _loaded(compiler: Path) -> ctypes.CDLL:
    """The shared library for these sources, compiler and CPU, from the cache (verified against
    the digest recorded when it was compiled) or compiled into it; a mismatch is compiled
    again once."""
    key = _key(compiler)
    directory = private_dir("native")  # a CacheError where others could write
    target = directory / f"merge-{key}.so"
    digest = directory / f"merge-{key}.sha256"
    if os.path.lexists(target) and (lib := _verified(target, digest)) is not None:
        return lib
    if os.path.lexists(target):
        warnings.warn(f"{target} is not the library moemerge compiled (no digest recorded, "
                      "another digest, or not a regular file of this user's that only they "
                      "can write): compiling it again", Note, stacklevel=3)
        target.unlink()
    _compile(compiler, target, digest)
    if (lib := _verified(target, digest)) is None:
        raise CacheError(f"{target} does not match its digest right after compiling it "
                         "(another process writing the same cache?)")
    return lib


def _key(compiler: Path) -> str:
    """Of the sources, the compiler and its version, the flags and the CPU."""
    done = run_tool([compiler, "--version"], what="the C compiler", timeout=VERSION_TIMEOUT)
    if done.returncode:
        raise ToolError(f"the C compiler ({compiler}) failed `--version` with exit code "
                        f"{done.returncode}")
    return hashlib.sha256("\0".join([*(s.read_text() for s in SOURCES), str(compiler),
                                     done.stdout, *FLAGS, platform.machine(),
                                     _cpu_flags()]).encode()).hexdigest()[:16]


def _compile(compiler: Path, target: Path, digest: Path) -> None:
    """Compile into a private temporary beside `target`, record its sha256 in `digest`, then
    rename it into place (atomic: another process loads a whole file or none)."""
    warnings.warn(f"compiling moemerge's merge kernel with {compiler} into {target.parent} "
                  "(once, about 10 s; MOEMERGE_NATIVE=0 does without it)", Note, stacklevel=4)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".merge-", suffix=".so")
    os.close(fd)
    try:
        done = run_tool([compiler, *FLAGS, "-o", tmp, *SOURCES], what="the C compiler",
                        timeout=COMPILE_TIMEOUT)
        if done.returncode:
            raise ToolError(f"the C compiler ({compiler}) failed with exit code "
                            f"{done.returncode}:\n{last_lines(done)}")
        os.chmod(tmp, 0o700)  # the linker gives the umask's mode
        with open(tmp, "rb") as f:
            _write_private(digest, hashlib.sha256(f.read()).hexdigest())
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _write_private(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _verified(target: Path, digest: Path) -> ctypes.CDLL | None:
    """The library at `target`, loaded from the very file whose bytes were hashed (through
    /proc/self/fd where there is one, so nothing can be swapped in between), or None when it
    is not a regular file of the user's own that only they can write, or its sha256 is not the
    one in `digest`."""
    expected = _private_text(digest)
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # a symlink (ELOOP), or gone
        return None
    try:
        if expected is None or not _private(os.fstat(fd)):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            if hashlib.sha256(f.read()).hexdigest() != expected.strip():
                return None
        by_fd = f"/proc/self/fd/{fd}"
        return ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(target))
    finally:
        os.close(fd)


def _private_text(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        return f.read() if _private(os.fstat(fd)) else None


def _private(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native builds for them): a library made on another CPU
    sharing the cache is never loaded here."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def ties(base: Tensor, tensors: Sequence[Tensor], weights, *, density, lam: float,
         trim_rounding: str = "ceil", normalize: bool = True, consensus: str = "sum",
         zero_vote: str = "none", dtype: torch.dtype) -> Tensor | None:
    """methods.ties of the whole tensor, in `dtype`, the same bytes; None where the kernel
    does not apply (see the module docstring) or is not built."""
    inputs = [base, *tensors]
    if (not 1 <= len(tensors) <= MAX_MODELS or trim_rounding == "sort" or consensus != "sum"
            or dtype not in DTYPES or base.numel() == 0
            or any(t.device.type != "cpu" or t.dtype != base.dtype for t in inputs)
            or base.dtype not in DTYPES or (lib := library()) is None):
        return None
    densities = per_model(density, len(tensors))
    for d in densities:
        check_density(d)
    inputs = [t.contiguous() for t in inputs]
    thresholds = _thresholds(lib, inputs, densities, trim_rounding)
    w = weights_of(weights, len(tensors), normalize=False)
    if bool((w == 1).all()):
        w = None  # torch skips multiplying by unit weights (exact either way)
    out = buffers.empty(base.shape, dtype)

    def merge(start: int, length: int) -> None:
        lib.ties_merge(*_call(inputs, start, length), thresholds.data_ptr(),
                       None if w is None else w.data_ptr(), float(lam), int(normalize),
                       int(zero_vote == "positive"), out.data_ptr() + start * out.element_size(),
                       DTYPES[dtype])

    _in_parts(base.numel(), merge)
    return out


def _call(inputs: list[Tensor], start: int, length: int) -> tuple:
    """The kernels' first arguments for entries start..start+length of base and models."""
    offset = start * inputs[0].element_size()
    models = (ctypes.c_void_p * (len(inputs) - 1))(*(t.data_ptr() + offset for t in inputs[1:]))
    return inputs[0].data_ptr() + offset, models, len(inputs) - 1, length, DTYPES[inputs[0].dtype]


@functools.cache
def _threads() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_cores(), "moemerge-kernel")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _in_parts(count: int, run: Callable[[int, int], object]) -> list:
    """run(start, length) over [0, count) in one contiguous part per core, side by side (ctypes
    releases the GIL; every entry's arithmetic is its own, so the bytes do not depend on the
    parts); tensors under 2 · PART entries in one call. The results, in order."""
    parts = max(1, min(_cores(), count // PART))
    if parts == 1:
        return [run(0, count)]
    step = -(-count // parts)
    futures = [_threads().submit(run, s, min(step, count - s)) for s in range(0, count, step)]
    return [f.result() for f in futures]


def consensus(base: Tensor, taus: Tensor, w: Tensor, lam: float, *, normalize: bool,
              consensus: str, zero_vote: str) -> Tensor | None:
    """methods.consensus_merge (elect, disjoint mean, θ_base + λ · that) of the sparsified
    task vectors `taus` [N, *shape] float32, in float32, the same bytes; None where the kernel
    does not apply or is not built."""
    if (not 1 <= taus.shape[0] <= MAX_MODELS or consensus != "sum" or base.numel() == 0
            or base.dtype not in DTYPES or taus.dtype != torch.float32
            or base.device.type != "cpu" or taus.device.type != "cpu"
            or (lib := library()) is None):
        return None
    base, taus = base.contiguous(), taus.contiguous()
    weights = None if bool((w == 1).all()) else w.to(torch.float32).contiguous()
    out = torch.empty(base.shape, dtype=torch.float32)
    lib.ties_consensus(base.data_ptr(), taus.data_ptr(), taus.shape[0], base.numel(),
                       DTYPES[base.dtype], None if weights is None else weights.data_ptr(),
                       float(lam), int(normalize), int(zero_vote == "positive"), out.data_ptr(),
                       DTYPES[torch.float32])
    return out


def _thresholds(lib, inputs: list[Tensor], densities: list[float], rounding: str) -> Tensor:
    """Each model's trim cut-off [N] float32: the k-th largest |τ_i| (0 at density 1), exactly
    the value torch's select finds (blocks.kth_largest, primitives.trim_threshold): the bucket
    of the top 16 bits that holds it, then its low 15 bits within that bucket. Each pass's
    counts are summed over the tensor's parts."""
    n, count = len(densities), inputs[0].numel()

    def histogram(function, width: int, *args) -> Tensor:  # [n, width]: every part's, summed
        def part(start: int, length: int) -> Tensor:
            counts = torch.zeros((n, width), dtype=torch.int64)
            function(*_call(inputs, start, length), *args, counts.data_ptr())
            return counts
        return torch.stack(_in_parts(count, part)).sum(0)

    high = histogram(lib.ties_histogram, BUCKETS)
    ks = torch.tensor([keep_count(count, d, rounding) for d in densities])
    buckets, ranks = select_bins(high, ks)
    keys = buckets.to(torch.int32)
    low = histogram(lib.ties_histogram_low, LOW, keys.data_ptr())  # (pointers: held tensors)
    lows, _ = select_bins(low, ranks)
    values = ((buckets << 15) | lows).to(torch.int32).view(torch.float32)
    return torch.where(torch.tensor(densities) < 1.0, values, 0.0)



def keep(draws, model: int, tau: Tensor, probs: Tensor) -> Tensor | None:
    """draws.Draws.keep (τ · (u < p), p one float32 or one per entry) in the kernel, the same
    bytes; None for a GPU tensor, another dtype, or no kernel."""
    per_entry = probs.dim() > 0
    if (tau.device.type != "cpu" or tau.dtype != torch.float32 or probs.device.type != "cpu"
            or probs.dtype != torch.float32 or (per_entry and probs.shape != tau.shape)
            or (lib := library()) is None):
        return None
    tau = tau.contiguous()
    probs = probs.contiguous() if per_entry else probs
    out = torch.empty_like(tau, memory_format=torch.contiguous_format)
    s1, s2 = draws.streams(model)
    lib.draws_keep(tau.data_ptr(), probs.data_ptr() if per_entry else None,
                   0.0 if per_entry else float(probs), tau.numel(), draws.offset, s1, s2,
                   out.data_ptr())
    return out
