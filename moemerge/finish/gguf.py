"""`build --gguf`: a GGUF file next to the safetensors, through llama.cpp's own converter.

The converter (`convert_hf_to_gguf.py`, with the `gguf-py` package beside it) is not on PyPI by
itself: it comes with a llama.cpp checkout, or with the `llama-cpp-python` sdist (under
vendor/llama.cpp). moemerge runs it with its own Python (torch, numpy, transformers); the
`[gguf]` extra adds what else it needs for SentencePiece vocabularies (`sentencepiece`).
Measured agreement with transformers: benchmarks/results/downstream.md.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import sys
import warnings
from pathlib import Path

from moemerge.architectures.tables import expert_count_keys, moe_layouts
from moemerge.build_options import GGUF_TYPES
from moemerge.errors import Note, RecipeError, ToolError
from moemerge.external import last_lines, run_tool

ENV = "LLAMA_CPP_DIR"
SCRIPT = "convert_hf_to_gguf.py"
CONSOLE_SCRIPT = "llama-convert-hf-to-gguf"  # `pip install ./llama.cpp` installs it
HOW_TO_GET = (
    f"give --llama-cpp DIR or set ${ENV} to a llama.cpp checkout (`git clone "
    "https://github.com/ggml-org/llama.cpp`) or to an unpacked llama-cpp-python sdist (`pip "
    "download --no-deps --no-binary :all: llama-cpp-python`, then untar it), and `pip install "
    "'moemerge[gguf]'` for the converter's sentencepiece"
)


def check_outtype(outtype: str) -> None:
    if outtype not in GGUF_TYPES:
        raise RecipeError(f"--gguf: must be one of {', '.join(GGUF_TYPES)}, got {outtype!r}")


# llama.cpp's LLAMA_MAX_EXPERTS (src/llama-hparams.h, the llama.cpp of llama-cpp-python 0.3.36):
# a GGUF with more experts per layer fails its loader's assertion
LLAMA_CPP_MAX_EXPERTS = 1024


def too_many_experts(config: dict) -> str | None:
    """Why llama.cpp cannot load an MoE of this config's expert count, or None."""
    keys = expert_count_keys()
    count = next((config[key] for key in keys if isinstance(config.get(key), int)), 0)
    if count > LLAMA_CPP_MAX_EXPERTS:
        return (f"{count} experts per layer: llama.cpp loads at most {LLAMA_CPP_MAX_EXPERTS} "
                "(LLAMA_MAX_EXPERTS), so no GGUF of this model runs there; transformers loads "
                "it")
    return None


def check_layout_converts(config: dict) -> None:
    """Before any tensor is read (from the planned config.json): an MoE layout llama.cpp's
    converter does not know is refused, naming those it does."""
    layouts = moe_layouts().values()
    architecture = (config.get("architectures") or [None])[0]
    layout = next((lay for lay in layouts if lay.architecture == architecture), None)
    if layout is not None and not layout.llama_cpp_converts:
        converts = ", ".join(f"{lay.name} ({lay.architecture})" for lay in layouts
                             if lay.llama_cpp_converts and lay.builds)
        raise RecipeError(f"--gguf: llama.cpp's converter does not know the {layout.name} "
                          f"layout ({architecture}); it converts dense merges, upcycles and "
                          f"these token-routed layouts: {converts}. Build without --gguf, or "
                          "from sources that give one of them")
    if layout is not None and layout.shared_count_key is not None and \
            not config.get(layout.shared_count_key):
        raise RecipeError(f"--gguf: llama.cpp's {layout.model_type} graph needs a shared expert "
                          f"in every MoE layer, and this {layout.name} model has none "
                          f"({layout.shared_count_key}: null). Give the recipe a shared_expert "
                          "(base, average or a model), or build without --gguf")
    if (problem := too_many_experts(config)) is not None:
        raise RecipeError(f"--gguf: {problem}. Build without --gguf")


def find_converter(llama_cpp: Path | None) -> list[str]:
    """The command that runs llama.cpp's converter, every path in it absolute: from --llama-cpp
    DIR (relative to the working directory, as typed), else $LLAMA_CPP_DIR (which must be
    absolute: a relative one would run whatever script the working directory holds), else the
    console script on PATH. A RecipeError (exit 2) saying how to get it otherwise."""
    if llama_cpp is None and os.environ.get(ENV) and not Path(os.environ[ENV]).is_absolute():
        raise RecipeError(f"${ENV} is {os.environ[ENV]!r}, a relative path: moemerge would run "
                          f"the {SCRIPT} of whatever directory it is started in. Set it to an "
                          "absolute path, or give --llama-cpp DIR")
    where = llama_cpp if llama_cpp is not None else (
        Path(os.environ[ENV]) if os.environ.get(ENV) else None)
    if where is not None:
        origin = "--llama-cpp" if llama_cpp is not None else f"${ENV}"
        where = where.expanduser().absolute()
        for script in (where / SCRIPT, where / "vendor" / "llama.cpp" / SCRIPT):
            if script.is_file():
                return [str(Path(sys.executable).absolute()), str(script)]
        raise RecipeError(f"{origin} {where}: no {SCRIPT} there (nor under vendor/llama.cpp/); "
                          f"{HOW_TO_GET}")
    if (console := shutil.which(CONSOLE_SCRIPT)) is not None:
        return [str(Path(console).absolute())]
    raise RecipeError(f"--gguf needs llama.cpp's {SCRIPT}, which is not on PyPI by itself: "
                      f"{HOW_TO_GET}")


def check_vocabulary_support(model_dir: Path) -> None:
    if (model_dir / "tokenizer.model").is_file() and not importlib.util.find_spec(
            "sentencepiece"):
        raise RecipeError(f"{model_dir / 'tokenizer.model'}: a SentencePiece vocabulary, which "
                          "llama.cpp's converter reads with `sentencepiece`: pip install "
                          "'moemerge[gguf]' (the safetensors output is complete)")


def gguf_path(model_dir: Path, outtype: str) -> Path:
    return model_dir / f"model-{outtype}.gguf"


# the converter's time limit unless --gguf-timeout: 10 minutes, and 10 more per GiB of weights
# (it converts the 135M model's 0.5 GiB in ~20 s on 2 cores: 30x that rate still fits)
BASE_TIMEOUT, TIMEOUT_PER_GIB = 600.0, 600.0


def default_timeout(model_dir: Path) -> float:
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return BASE_TIMEOUT + TIMEOUT_PER_GIB * weights / 2**30


def write_gguf(model_dir: Path, outtype: str, command: list[str],
               timeout: float | None = None) -> Path:
    """Convert `model_dir` to model_dir/model-OUTTYPE.gguf within `timeout` seconds (default:
    `default_timeout`). The converter writes a `.partial` file that is renamed only once it
    exits 0 and the `.partial` is a regular file starting with GGUF's magic, so a `.gguf` that
    exists is a whole one; anything else it leaves is removed."""
    check_vocabulary_support(model_dir)
    out = gguf_path(model_dir, outtype)
    partial = out.with_name(out.name + ".partial")
    timeout = default_timeout(model_dir) if timeout is None else timeout
    tool = f"{out}: llama.cpp's converter ({' '.join(command)})"
    warnings.warn(f"running llama.cpp's converter: {' '.join(command)} (stopped after "
                  f"{timeout:g} s)", Note, stacklevel=2)
    try:
        done = run_tool([*command, model_dir, "--outtype", outtype, "--outfile", partial],
                        what=tool, timeout=timeout)
        if done.returncode:
            raise ToolError(f"{tool} failed with exit code {done.returncode}; the safetensors "
                            f"output is complete. Its last lines:\n{last_lines(done)}")
        if (problem := _not_a_gguf(partial)) is not None:
            raise ToolError(f"{tool} exited 0 but {problem}; the safetensors output is "
                            "complete, no GGUF was written")
        os.replace(partial, out)
    finally:
        _remove(partial)
    return out


def _not_a_gguf(path: Path) -> str | None:
    """What is wrong with the converter's output file, or None for a regular GGUF file."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return f"wrote no {path.name}"
    if stat.S_ISLNK(st.st_mode):
        return f"left {path.name} as a symlink (to {os.readlink(path)})"
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "no regular file"
        return f"left {path.name} as {kind}"
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            return f"left {path.name} without GGUF's magic bytes: it is no GGUF file"
    return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
