"""A PEFT LoRA adapter applied to a checkpoint as it is read (the recipe's `model: base+adapter`
or `{model: base, lora: adapter}`; docs/lora.md).

`AdapterReader` wraps the base's reader and presents what peft's `merge_and_unload()` gives,
one tensor at a time, with no merged copy written anywhere:

- a targeted linear: W + s·B·A (A [r, in], B [out, r]);
- a targeted embedding: W + s·(B·A)ᵀ (peft's `lora_embedding_A` [r, V], `lora_embedding_B`
  [H, r]);
- s = lora_alpha / r, or lora_alpha / √r with `use_rslora`; r and lora_alpha per module from
  `rank_pattern` / `alpha_pattern` as peft matches them (`get_pattern_key`: the first key K
  for which `(.*\\.)?(K)$` matches the module's full name);
- a whole tensor the adapter saved (`modules_to_save`, the biases of `bias: all` or
  `lora_only`, the embedding peft saves beside an embedding LoRA) replaces the base's, as
  peft's loading does, before any delta is added; `lora_bias`: bias + s·b.

The delta is computed in float32 (peft upcasts the adapter's weights to float32 when it loads
them) and added to the float32 weight, then cast to the base's dtype, as peft's in-place
`weight += delta` does. Every other tensor is the base's, its bytes copied as they are.
`fan_in_fan_out` is ignored as peft ignores it on a `torch.nn.Linear` (every family moemerge
reads stores its projections so; GPT-2's Conv1D is not one of them).

Refused, naming the adapter: peft types other than LORA, LoRA variants (DoRA, aLoRA, …),
`target_parameters`, `layer_replication`, `trainable_token_indices`, adapters whose
initialisation changed the base weights (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA: convert them to
a plain LoRA first), a tensor the adapter does not explain, and a pickled `.bin` adapter
unless `allow_pickle`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moemerge.errors import CheckpointError, MismatchError
from moemerge.io import jsontext
from moemerge.io.paths import check_no_link_loops, confined
from moemerge.io.reader import (
    CheckpointReader,
    DerivedReader,
    RawFile,
    TensorMeta,
    read_safetensors_header,
)
from moemerge.io.resolve import looks_like_path

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE, PICKLE_FILE = "adapter_model.safetensors", "adapter_model.bin"
PREFIX = "base_model.model."
# LoraConfig fields that make another computation than W + s·B·A (peft marks most of them
# `is_lora_variant`): set, the adapter is refused
VARIANTS = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "alora_invocation_tokens": "aLoRA (activated LoRA: applied only after its invocation "
                               "tokens, so it has no merged form)",
    "velora_config": "VeLoRA", "monteclora_config": "MonteCLoRA", "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow routing", "kasa_config": "KaSA", "use_qalora": "QA-LoRA",
    "target_parameters": "target_parameters (LoRA on nn.Parameters, e.g. fused MoE experts)",
    "layer_replication": "layer_replication (layers repeated by the adapter)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
}
# initialisations that change the base weights themselves: the adapter belongs to a residual
# model, not to the base it names, until peft converts it
BASE_CHANGING = ("pissa", "olora", "corda", "loftq", "lora_ga")


@dataclass(frozen=True)
class LoraModule:
    """One targeted module: its factors, rank and scale."""

    module: str  # the module's full name, e.g. model.layers.0.self_attn.q_proj
    embedding: bool  # peft's Embedding (delta transposed) rather than Linear
    a: TensorMeta
    b: TensorMeta
    r: int
    alpha: float
    scale: float
    bias: TensorMeta | None = None  # lora_bias: lora_B's bias

    @property
    def weight(self) -> str:
        return f"{self.module}.weight"

    def describe(self) -> str:
        return f"base + LoRA r={self.r}" + (" (embedding)" if self.embedding else "")


class _AdapterFile:
    """adapter_model.safetensors (or, allowed, adapter_model.bin) read tensor by tensor."""

    def __init__(self, file: Path):
        self.file = file
        self._handle = None
        if file.suffix == ".safetensors":
            self.metas = read_safetensors_header(file)
        else:
            try:
                self._handle = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # any failure to open is this file's fault
                raise CheckpointError(f"{file}: cannot open: {exc}") from None
            if not isinstance(self._handle, dict):
                raise CheckpointError(f"{file} does not hold a state dict")
            self.metas = {n: TensorMeta(n, t.dtype, tuple(t.shape), file)
                          for n, t in self._handle.items() if isinstance(t, torch.Tensor)}

    def read(self, name: str) -> torch.Tensor:
        meta = self.metas[name]
        try:
            if self._handle is not None:
                return self._handle[name].clone()
            raw = RawFile(self.file)
            try:
                return raw.read(meta)
            finally:
                raw.close()
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{self.file}: cannot read tensor {name!r}: {exc}") from None


def pattern_key(keys, module: str) -> str | None:
    """peft's get_pattern_key: the first key K for which `(.*\\.)?(K)$` matches the module's
    full name from its start."""
    for key in keys:
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return key
        except re.error as exc:
            raise CheckpointError(f"pattern {key!r} is not a regular expression: {exc}") from None
    return None


class LoraAdapter:
    """A PEFT LoRA adapter directory, opened (config and tensor headers; the factors are read
    when a tensor that needs them is)."""

    def __init__(self, directory: Path, *, allow_pickle: bool = False):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"LoRA adapter {directory} is not a directory")
        check_no_link_loops(self.directory)
        self.config = self._read_config()
        self.where = f"the LoRA adapter {self.directory}"
        self._check_config()
        self.notes: list[str] = []  # what the build should say about it
        if self.config.get("fan_in_fan_out"):
            self.notes.append(f"{self.where}: fan_in_fan_out is ignored, as peft ignores it on "
                              "a torch.nn.Linear (it is for GPT-2's Conv1D, which no family "
                              "moemerge reads uses)")
        self.file = _AdapterFile(self._weights(allow_pickle))
        self.modules: dict[str, LoraModule] = {}  # weight tensor name -> its LoRA
        self.replaced: dict[str, str] = {}  # tensor name -> the adapter's tensor replacing it
        self._parse()

    # --- the files ------------------------------------------------------------------------

    def _read_config(self) -> dict:
        file = self.directory / CONFIG_FILE
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: a PEFT adapter directory holds "
                                  f"{CONFIG_FILE} and {SAFETENSORS_FILE}")
        confined(Path(file.name), self.directory)
        try:
            config = jsontext.loads(file.read_text())
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{file} is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(config, dict):
            raise CheckpointError(f"{file} is not a JSON object")
        return config

    def _weights(self, allow_pickle: bool) -> Path:
        safetensors, pickle = self.directory / SAFETENSORS_FILE, self.directory / PICKLE_FILE
        if safetensors.is_file():
            return confined(Path(SAFETENSORS_FILE), self.directory, "weight file")
        if pickle.is_file():
            if not allow_pickle:
                raise CheckpointError(
                    f"{pickle} is a pickled adapter; pickles can run code when loaded. Convert "
                    "it to safetensors, or pass --allow-pickle if you trust it (it is then "
                    "loaded with weights_only=True).")
            return confined(Path(PICKLE_FILE), self.directory, "weight file")
        raise CheckpointError(f"{self.directory} holds no {SAFETENSORS_FILE} (nor "
                              f"{PICKLE_FILE}); a hub adapter's .bin is not downloaded")

    # --- what it is -----------------------------------------------------------------------

    def _check_config(self) -> None:
        config, where = self.config, f"{self.where} ({CONFIG_FILE})"
        kind = config.get("peft_type")
        if kind != "LORA":
            raise CheckpointError(f"{where} is a {kind} adapter (peft_type); moemerge applies "
                                  "LoRA adapters only")
        for field, what in VARIANTS.items():
            if config.get(field):
                raise CheckpointError(f"{where} uses {what} ({field}), which moemerge does not "
                                      "apply; merge it with peft (merge_and_unload) instead")
        init = config.get("init_lora_weights")
        if isinstance(init, str) and (init in BASE_CHANGING or init.startswith("pissa")
                                      or init == "mica"):
            raise CheckpointError(
                f"{where} was initialised with init_lora_weights={init!r}, which "
                f"{'is a LoRA variant' if init == 'mica' else 'changes the base weights'}: it "
                "applies to another model than its base. Convert it to a plain LoRA adapter "
                "first (peft's save_pretrained(..., path_initial_model_for_weight_conversion=…))")
        if config.get("bias", "none") not in ("none", "all", "lora_only"):
            raise CheckpointError(f"{where}: bias {config.get('bias')!r} is not one of none, "
                                  "all, lora_only")
        for key in ("r", "lora_alpha"):
            value = config.get(key)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0 \
                    or not math.isfinite(value):
                raise CheckpointError(f"{where}: {key} is {value!r}, not a positive number")
        for key in ("rank_pattern", "alpha_pattern"):
            value = config.get(key) or {}
            if not isinstance(value, dict) or not all(
                    isinstance(v, int | float) and not isinstance(v, bool) and v > 0
                    for v in value.values()):
                raise CheckpointError(f"{where}: {key} must map module patterns to positive "
                                      "numbers")

    def rank_and_alpha(self, module: str) -> tuple[int, float]:
        """(r, lora_alpha) of one module, patterns applied as peft applies them."""
        ranks = self.config.get("rank_pattern") or {}
        alphas = self.config.get("alpha_pattern") or {}
        try:
            r_key, a_key = pattern_key(ranks, module), pattern_key(alphas, module)
        except CheckpointError as exc:
            raise CheckpointError(f"{self.where}: {exc}") from None
        r = ranks[r_key] if r_key is not None else self.config["r"]
        alpha = alphas[a_key] if a_key is not None else self.config["lora_alpha"]
        return int(r), float(alpha)

    def scale(self, r: int, alpha: float) -> float:
        """peft's scaling: alpha / r, or alpha / √r with use_rslora."""
        return alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r

    def _parse(self) -> None:
        factors: dict[str, dict[str, TensorMeta]] = {}
        for key, meta in self.file.metas.items():
            if not key.startswith(PREFIX):
                raise CheckpointError(f"{self.file.file}: tensor {key!r} is not a PEFT adapter "
                                      f"tensor (its names start with {PREFIX!r})")
            name = key[len(PREFIX):]
            for suffix, part in ((".lora_A.weight", "A"), (".lora_B.weight", "B"),
                                 (".lora_B.bias", "bias"), (".lora_embedding_A", "eA"),
                                 (".lora_embedding_B", "eB")):
                if name.endswith(suffix):
                    factors.setdefault(name[:-len(suffix)], {})[part] = meta
                    break
            else:
                if "lora_" in name or "token_adapter" in name:
                    raise CheckpointError(
                        f"{self.file.file}: tensor {key!r} is not a plain LoRA factor (a LoRA "
                        "variant or trainable tokens, which moemerge does not apply)")
                whole = (name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
                         .replace(".modules_to_save.", "."))
                if whole in self.replaced:
                    raise CheckpointError(f"{self.file.file}: tensors {self.replaced[whole]!r} "
                                          f"and {key!r} both replace {whole!r}")
                self.replaced[whole] = key
        for module, parts in factors.items():
            embedding = "eA" in parts or "eB" in parts
            a, b = (parts.get("eA"), parts.get("eB")) if embedding else (parts.get("A"),
                                                                         parts.get("B"))
            if a is None or b is None or (embedding and ("A" in parts or "B" in parts)):
                raise CheckpointError(f"{self.file.file}: module {module!r} has "
                                      f"{', '.join(sorted(parts))} but not one A and one B factor")
            r, alpha = self.rank_and_alpha(module)
            if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != r or b.shape[1] != r:
                raise CheckpointError(
                    f"{self.where}: module {module!r} has factors A {list(a.shape)} and B "
                    f"{list(b.shape)}, not of rank {r} (its r from adapter_config.json)")
            lora = LoraModule(module, embedding, a, b, r, alpha, self.scale(r, alpha),
                              parts.get("bias"))
            self.modules[lora.weight] = lora

    @property
    def base_model(self) -> str | None:
        value = self.config.get("base_model_name_or_path")
        return value if isinstance(value, str) and value else None

    def read(self, key: str) -> torch.Tensor:
        return self.file.read(key)


class AdapterReader(DerivedReader):
    """A checkpoint reader (`CheckpointReader`, `ExpertReader`) with a LoRA adapter applied:
    the same tensors, names, shapes and dtypes, each targeted one made when read. The base's
    reader is closed by its owner."""

    def __init__(self, base: CheckpointReader, adapter: LoraAdapter, label: str):
        self.base, self.adapter = base, adapter
        self.directory, self.config = base.directory, base.config
        self.form, self.on_disk, self.allow_pickle = base.form, base.on_disk, base.allow_pickle
        where = f"{label} ({base.directory})"
        metas = dict(base.metas)
        for name, key in adapter.replaced.items():
            own = self._target(name, where, f"tensor {key!r}")
            meta = adapter.file.metas[key]
            if meta.shape != own.shape:
                raise MismatchError(
                    f"shape mismatch for tensor {name!r}: {list(meta.shape)} in {adapter.where} "
                    f"({key!r}) but {list(own.shape)} in {where}; the adapter was made for "
                    "another model")
            metas[name] = TensorMeta(name, own.dtype, own.shape, meta.file)
        for name, lora in adapter.modules.items():
            own = self._target(name, where, f"module {lora.module!r}")
            self._check_factors(lora, own, where)
            if lora.bias is not None:
                bias = self._target(f"{lora.module}.bias", where,
                                    f"the lora_bias of {lora.module!r} (peft refuses it too: "
                                    "the base layer has no bias)")
                if tuple(lora.bias.shape) != tuple(bias.shape):
                    raise MismatchError(f"shape mismatch for tensor {bias.name!r}: lora_B's bias "
                                        f"is {list(lora.bias.shape)} in {adapter.where} but "
                                        f"{list(bias.shape)} in {where}")
                metas[bias.name] = TensorMeta(bias.name, bias.dtype, bias.shape, base.directory)
            metas[name] = TensorMeta(name, own.dtype, own.shape, base.directory)
        self.metas = metas
        self._biases = {f"{m.module}.bias": m for m in adapter.modules.values()
                        if m.bias is not None}

    def _target(self, name: str, where: str, what: str) -> TensorMeta:
        if name not in self.base:
            tied = (" (its head is tied to the embedding)"
                    if name.startswith("lm_head.") and self.config.get("tie_word_embeddings")
                    else "")
            raise MismatchError(f"{self.adapter.where}: {what} needs tensor {name!r}, which "
                                f"{where} does not have{tied}; the adapter was made for another "
                                "model")
        return self.base.meta(name)

    def _check_factors(self, lora: LoraModule, own: TensorMeta, where: str) -> None:
        """A [r, in] and B [out, r] against W [out, in]; an embedding's A [r, V], B [H, r]
        against W [V, H]."""
        if len(own.shape) != 2:
            raise MismatchError(f"{self.adapter.where}: module {lora.module!r} is a LoRA target "
                                f"but {own.name!r} is {list(own.shape)} in {where}, not a matrix")
        rows, cols = own.shape
        wants = ((cols, rows) if lora.embedding else (rows, cols))  # (B's rows, A's columns)
        if (lora.b.shape[0], lora.a.shape[1]) != wants:
            raise MismatchError(
                f"shape mismatch for tensor {own.name!r}: {list(own.shape)} in {where} but the "
                f"LoRA factors A {list(lora.a.shape)} and B {list(lora.b.shape)} of "
                f"{self.adapter.where} make {list(wants[::-1] if lora.embedding else wants)}; "
                "the adapter was made for another model")

    # --- the reader's interface -----------------------------------------------------------

    def describe(self, name: str) -> str | None:
        """How the adapter changes tensor `name` (the --dry-run plan), None when it does not."""
        whole = name in self.adapter.replaced
        if name in self.adapter.modules:
            made = self.adapter.modules[name].describe()
            return made.replace("base", "the adapter's saved tensor", 1) if whole else made
        if name in self._biases:
            lora = self._biases[name]
            return f"{'the adapter' if whole else 'base'} + lora_bias of LoRA r={lora.r}"
        return "the adapter's saved tensor (modules_to_save)" if whole else None

    def working_bytes(self, name: str) -> int:
        """What making tensor `name` holds beyond the tensor made: the float32 delta and
        weight, the stored weight and the factors (0 for a tensor read as stored)."""
        lora = self.adapter.modules.get(name)
        if lora is None:
            return 0
        meta = self.metas[name]
        numel = math.prod(meta.shape)
        factors = 4 * (math.prod(lora.a.shape) + math.prod(lora.b.shape))
        cast = 4 * numel + meta.nbytes if meta.dtype != torch.float32 else 0
        return 4 * numel + cast + factors

    def stored(self, name: str) -> TensorMeta | None:
        """Bytes to copy as they are: an untouched tensor's, or a replacing tensor's when it is
        stored in the base's dtype and no delta is added to it."""
        if name in self.adapter.modules or name in self._biases:
            return None
        key = self.adapter.replaced.get(name)
        if key is None:
            return self.base.stored(name)
        meta = self.adapter.file.metas[key]
        same = meta.offset >= 0 and meta.dtype == self.metas[name].dtype
        return replace(meta, name=name) if same else None

    def read(self, name: str) -> torch.Tensor:
        dtype = self.meta(name).dtype
        key = self.adapter.replaced.get(name)
        weight = (self.adapter.read(key).to(dtype) if key is not None
                  else self.base.read(name))
        lora = self.adapter.modules.get(name)
        if lora is not None:
            delta = self.adapter.read(lora.b.name).float() @ self.adapter.read(lora.a.name).float()
            delta = (delta.T if lora.embedding else delta) * lora.scale
            return _added(weight, delta)
        lora = self._biases.get(name)
        if lora is not None:
            assert lora.bias is not None
            return _added(weight, self.adapter.read(lora.bias.name).float() * lora.scale)
        return weight


def base_name_note(adapter: LoraAdapter, model: str, local: bool, path: Path,
                   label: str) -> str | None:
    """A note when the adapter names another base of the same kind of reference: two hub ids
    that differ, or two local directories (both existing here) that are not the same; None
    otherwise (a hub id against a local copy cannot be compared)."""
    named = adapter.base_model
    if named is None:
        return None
    own = Path(named).expanduser()
    named_local = looks_like_path(named) or own.is_dir()
    if named_local != local:
        return None
    differs = (own.is_dir() and own.resolve() != Path(path).resolve() if local
               else named.lower() != model.lower())
    if not differs:
        return None
    return (f"{label}: {adapter.where} was trained on {named} (its base_model_name_or_path) and "
            f"is applied to {model}: the shapes fit, but its deltas were learned on the other "
            "model")


def _added(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """weight + delta in float32, cast back to weight's dtype (peft's in-place
    `weight += delta` of a float32 delta)."""
    if weight.dtype == torch.float32:
        return weight.add_(delta)
    dtype = weight.dtype
    return weight.float().add_(delta).to(dtype)
