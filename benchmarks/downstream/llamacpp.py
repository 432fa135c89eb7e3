"""llama.cpp from the package registry: the `llama-cpp-python` sdist vendors llama.cpp (C++
sources, `convert_hf_to_gguf.py`, `gguf-py`) and its own ctypes binding. Everything lives under
one cache directory:

    CACHE/dl/                      the downloaded sdist and wheels
    CACHE/llama_cpp_python-X/      the unpacked sdist (binding in llama_cpp/, vendor/llama.cpp/)
    CACHE/build/bin/               libllama.so + libggml*.so, CPU only (cmake, target `llama`)
    CACHE/site/                    sentencepiece and diskcache (pip --target; the converter
                                   and the binding need them, the project's env does not)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

SDIST = "llama-cpp-python>=0.3,<0.4"
SITE_PACKAGES = ("sentencepiece", "diskcache")
# only the library: no tools, examples, server, tests, OpenMP or HTTPS
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_COMMON=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DGGML_OPENMP=OFF"]
LOCK = "/tmp/torch.lock"  # compiling competes with the torch jobs on a shared machine


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download(cache: Path, spec: str, binary: bool = True) -> Path:
    """pip download one distribution (no dependencies) into CACHE/dl; its path."""
    dl = cache / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    name = spec.split("[")[0].split("<")[0].split(">")[0].split("=")[0].replace("-", "_").lower()
    found = sorted(p for p in dl.iterdir() if p.name.lower().startswith(name + "-"))
    if not found:
        pip("download", "-q", "--no-deps", "-d", str(dl), spec,
            *(() if binary else ("--no-binary", ":all:")))
        found = sorted(p for p in dl.iterdir() if p.name.lower().startswith(name + "-"))
    return found[-1]


def sdist_dir(cache: Path) -> Path:
    archive = download(cache, SDIST, binary=False)
    root = cache / archive.name.removesuffix(".tar.gz")
    if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(cache, filter="data")
    return root


def converter(cache: Path) -> Path:
    return sdist_dir(cache) / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"


def site_dir(cache: Path) -> Path:
    site = cache / "site"
    if not all((site / p).is_dir() for p in SITE_PACKAGES):
        pip("install", "-q", "--no-deps", "--target", str(site), *SITE_PACKAGES)
    return site


def lib_dir(cache: Path) -> Path:
    """Build libllama for this CPU once (about 2 min on 2 cores); the folder holding it."""
    build = cache / "build"
    if not (build / "bin" / "libllama.so").is_file():
        source = sdist_dir(cache) / "vendor" / "llama.cpp"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True)
        lock = ["flock", LOCK] if Path(LOCK).exists() else []
        subprocess.run([*lock, "cmake", "--build", str(build), "--target", "llama", "-j2"],
                       check=True)
    return build / "bin"


def setup(cache: Path) -> None:
    """Fetch, unpack and build everything; then `import llama_cpp` works in this process."""
    site, sdist, lib = site_dir(cache), sdist_dir(cache), lib_dir(cache)
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib)
    for path in (str(site), str(sdist)):
        if path not in sys.path:
            sys.path.insert(0, path)


def convert(cache: Path, model: Path, out: Path, outtype: str) -> Path:
    """convert_hf_to_gguf.py MODEL --outtype OUTTYPE, run with this Python (torch, numpy,
    transformers) plus CACHE/site; `out` is written whole or not at all."""
    if out.is_file():
        return out
    partial = out.with_name(out.name + ".partial")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site_dir(cache)), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(converter(cache)), str(model), "--outtype",
                           outtype, "--outfile", str(partial)], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py {model} --outtype {outtype} failed:\n"
                           f"{done.stderr[-3000:]}")
    partial.replace(out)
    return out


def logits(gguf: Path, windows: list[list[int]]):
    """Per-token logits from llama.cpp for each window, the KV cache cleared between windows:
    yields float32 arrays [len(window), vocab]. The KV cache is f32 (its default, f16, would
    round keys and values) and flash attention off, so an f32 GGUF is computed in f32."""
    import llama_cpp
    import numpy as np

    ctx = max(len(w) for w in windows)
    llm = llama_cpp.Llama(str(gguf), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True,
                          n_threads=int(os.environ.get("OMP_NUM_THREADS", "2")),
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                          flash_attn=False, verbose=False)
    try:
        for window in windows:
            llm.reset()
            llm.eval(window)
            yield np.array(llm.scores[: len(window)], dtype=np.float32)
    finally:
        llm.close()
