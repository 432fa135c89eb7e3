"""Open the recipe's input models (headers only) and check that they can be merged together."""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from moemerge.architectures import DenseFamily, TensorRole, family_for_config
from moemerge.errors import CheckpointError, MismatchError
from moemerge.io import jsontext
from moemerge.io.adapter import AdapterReader, LoraAdapter, base_name_note
from moemerge.io.moe_expert import ExpertReader
from moemerge.io.paths import confined
from moemerge.io.reader import CheckpointReader
from moemerge.io.resolve import looks_like_path, resolve_model
from moemerge.plan.shapes import check_config_shapes, check_config_values
from moemerge.recipe.base import ModelRef

# config.json keys on which every input model must agree for tensors to line up
MUST_AGREE = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "tie_word_embeddings", "head_dim",
)


@dataclass
class SourceModel:
    label: str
    path: Path
    reader: CheckpointReader | ExpertReader | AdapterReader
    family: DenseFamily
    roles: dict[str, TensorRole]  # every tensor of the checkpoint, classified
    notes: list[str] = field(default_factory=list)  # for the build to say (the plan's notes)

    @property
    def config(self) -> dict:
        return self.reader.config

    def where(self) -> str:
        return f"{self.label} ({self.path})"


def resolve_ref(ref: ModelRef, recipe_dir: Path | None, hub: bool = True) -> Path:
    """A relative local path is looked up next to the recipe first, then in the working dir;
    then, with `hub`, a name that can be a hub id on the hub."""
    if recipe_dir is None or Path(ref.model).is_absolute():
        return resolve_model(ref.model, ref.revision)
    candidate = recipe_dir / ref.model
    if candidate.is_dir():
        return candidate.resolve()
    if candidate.exists():
        raise CheckpointError(f"model {ref.model} is the file {candidate}; a model is a "
                              "directory (config.json, weights, tokenizer) or a hub id")
    if _bundled(recipe_dir) and ref.model.split("/", 1)[0] == "toy":  # never a hub id
        toy = _shown(recipe_dir / "toy")
        raise CheckpointError(f"model directory {_shown(candidate)} does not exist: the bundled "
                              f"recipes use the toy experts; make them first with `moemerge toy "
                              f"{toy}`")
    looked = (f"looked for the directory {_shown(candidate)} next to the recipe and "
              f"{_shown(Path.cwd() / ref.model)} in the working directory")
    if not hub and not Path(ref.model).expanduser().is_dir():
        raise CheckpointError(f"no such directory ({looked}); as a hub id it is not looked up "
                              "while a local model is missing")
    try:
        return resolve_model(ref.model, ref.revision, near=(recipe_dir,))
    except CheckpointError as exc:
        raise CheckpointError(f"{exc} ({looked})") from None


def resolve_adapter(ref: ModelRef, recipe_dir: Path | None) -> Path:
    """The directory of a reference's LoRA adapter, found as a model is (next to the recipe
    first, then in the working directory, then on the hub)."""
    assert ref.lora is not None
    try:
        return resolve_ref(ModelRef(model=ref.lora, revision=ref.lora_revision), recipe_dir)
    except CheckpointError as exc:
        raise CheckpointError(f"LoRA adapter {ref.lora} (of {ref.model}): {exc}") from None


def resolve_refs(refs: list[tuple[str, ModelRef]], recipe_dir: Path | None) -> list[Path]:
    """The directory of every (label, ref), or one error that names every model not found.
    Local references are checked first, so no hub download starts before they are known."""
    near = (recipe_dir,) if recipe_dir is not None else ()
    local = [looks_like_path(ref.model, near) for _, ref in refs]
    paths: dict[int, Path] = {}
    missing: list[str] = []
    for i in sorted(range(len(refs)), key=lambda i: not local[i]):  # local references first
        label, ref = refs[i]
        try:  # no hub download while a local model is missing
            paths[i] = resolve_ref(ref, recipe_dir, hub=local[i] or not missing)
        except CheckpointError as exc:
            missing.append(f"{label}: {exc}")
    if missing:
        where = (f"relative paths are read next to the recipe ({_shown(recipe_dir)}), then in "
                 "the working directory; other names of the form org/name are hub ids"
                 if recipe_dir is not None else "")
        raise CheckpointError(f"{len(missing)} of {len(refs)} models not found"
                              + (f" ({where})" if where else "") + ":\n  - "
                              + "\n  - ".join(missing))
    return [paths[i] for i in range(len(refs))]


def _bundled(recipe_dir: Path) -> bool:
    """Whether `recipe_dir` is moemerge's own recipes directory (recipes/ in a checkout)."""
    from importlib import resources

    bundled = Path(str(resources.files("moemerge") / "recipes"))
    return bundled.is_dir() and recipe_dir.resolve() == bundled.resolve()


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is under it (as the user typed it)."""
    try:
        return str(path.absolute().relative_to(Path.cwd().absolute()))
    except ValueError:
        return str(path)


def open_sources(
    refs: list[tuple[str, ModelRef]],
    recipe_dir: Path | None,
    *,
    allow_pickle: bool,
    stack: ExitStack,
    compatible: bool = True,
    vocabularies: bool = True,
) -> list[SourceModel]:
    """Open every (label, ref) model; the readers are closed by `stack`. With `compatible`,
    check_compatible (one architecture, same shapes) says whether they can be combined;
    bridged experts may differ in both (their plan checks what it needs). `vocabularies`
    False: the vocabularies (tokenizers, embedding and head rows) may differ (a dense merge
    with a `tokenizer:` block aligns them)."""
    models = []
    for (label, ref), path in zip(refs, resolve_refs(refs, recipe_dir), strict=True):
        # (an MoE's experts one tensor each, however stored: merges plan them per expert)
        reader = stack.enter_context(CheckpointReader(path, allow_pickle=allow_pickle,
                                                      per_expert=True))
        if ref.expert is not None:  # one expert of an MoE, as a dense model
            reader = ExpertReader(reader, ref.expert, label)
        notes = []
        if ref.lora is not None:  # W + s·B·A per targeted tensor, made when read
            adapter = LoraAdapter(resolve_adapter(ref, recipe_dir), allow_pickle=allow_pickle)
            reader = AdapterReader(reader, adapter, label)
            local = looks_like_path(ref.model, (recipe_dir,) if recipe_dir else ())
            other = base_name_note(adapter, ref.model, local, path, label)
            notes = [*adapter.notes, *([other] if other else [])]
        check_config_values(reader.config, f"{label}: {path}")  # before any of it is used
        family = family_for_config(reader.config, f"{label} ({path}/config.json)")
        roles = {}
        for name in reader.names():
            role = family.classify(name)
            if role is None:
                raise MismatchError(
                    f"tensor {name!r} in {label} ({path}) is not a known {family.name}-family "
                    "tensor; moemerge will not guess what it is. Supported layouts are listed in "
                    "moemerge/architectures/dense.yaml."
                )
            roles[name] = role
        check_config_shapes(reader.config, roles,
                            {n: m.shape for n, m in reader.metas.items()}, f"{label}: {path}",
                            family.attention_shapes)
        models.append(SourceModel(label, path, reader, family, roles, notes))
    if compatible:
        check_compatible(models, vocabularies)
    return models


def check_compatible(models: list[SourceModel], vocabularies: bool = True) -> None:
    """Same family, same config shape keys, same tensor names and shapes, same vocabulary
    (`vocabularies` False: the vocabulary and the embedding and head rows may differ)."""
    ref = models[0]
    for other in models[1:]:
        if ref.family.layout is not None and other.family.layout == ref.family.layout:
            key = ref.family.must_agree[0]  # the expert count (its key in each config)
            a, b = ref.config.get(key), other.config.get(other.family.must_agree[0])
            if a != b:
                raise MismatchError(f"{ref.where()} has {a} experts per layer but "
                                    f"{other.where()} has {b}; MoEs merged expert by expert "
                                    "must have the same experts")
        if other.family.name != ref.family.name:
            raise MismatchError(
                f"architecture mismatch: {ref.where()} is {ref.config.get('model_type')} but "
                f"{other.where()} is {other.config.get('model_type')}; models merged together "
                "must share one architecture"
            )
        for key in (*MUST_AGREE, *ref.family.must_agree):
            if key == "vocab_size" and not vocabularies:
                continue
            a, b = ref.config.get(key), other.config.get(key)
            if a != b and not (key == "tie_word_embeddings" and not a and not b):
                raise MismatchError(
                    f"config mismatch: {key} is {a!r} in {ref.where()} but {b!r} in "
                    f"{other.where()}"
                )
        _check_tensors(ref, other, vocabularies)
        if vocabularies:
            _check_vocab(ref, other)


def _check_tensors(ref: SourceModel, other: SourceModel, vocabularies: bool = True) -> None:
    for name in ref.reader.names():
        if name not in other.reader:
            raise MismatchError(
                f"tensor {name!r} is in {ref.where()} but missing from {other.where()}"
            )
        a, b = ref.reader.meta(name).shape, other.reader.meta(name).shape
        if not vocabularies and ref.roles[name].role in ("embed", "lm_head"):
            a, b = a[1:], b[1:]  # rows: one per token of each model's own vocabulary
        if a != b:
            hint = ""
            if ref.roles[name].role in ("embed", "lm_head") and a[1:] == b[1:]:
                hint = f" (different vocabularies: {a[0]} vs {b[0]} tokens)"
            raise MismatchError(
                f"shape mismatch for tensor {name!r}: {list(a)} in {ref.where()} but {list(b)} "
                f"in {other.where()}{hint}"
            )
    extra = [n for n in other.reader.names() if n not in ref.reader]
    if extra:
        raise MismatchError(
            f"tensor {extra[0]!r} is in {other.where()} but missing from {ref.where()}"
            + (f" ({len(extra) - 1} more)" if len(extra) > 1 else "")
        )


def vocab_fingerprint(path: Path) -> str | None:
    """A hash of the tokenizer's vocabulary (tokenizer.json's model + added tokens), if any."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        data = jsontext.loads(confined(Path(file.name), path).read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{file} is not a valid tokenizer file: {str(exc)[:200]}") from None
    payload = json.dumps([data.get("model"), data.get("added_tokens")], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def _check_vocab(ref: SourceModel, other: SourceModel) -> None:
    files = [m.path / "tokenizer.json" for m in (ref, other)]
    if all(f.is_file() for f in files) and len({confined(Path(f.name), f.parent).read_bytes()
                                                for f in files}) == 1:
        return  # the same file: no need to parse 10-20 MB of JSON twice
    a, b = vocab_fingerprint(ref.path), vocab_fingerprint(other.path)
    if a is not None and b is not None and a != b:
        raise MismatchError(
            f"different vocabularies: the tokenizer of {other.where()} differs from that of "
            f"{ref.where()}; token ids would not line up. Merge only models that share a tokenizer."
        )


def check_moe_inputs(kind: str, takes_moes: bool, models: list[SourceModel]) -> None:
    """An MoE checkpoint is an input of kind: merge only (its experts merged with the same
    experts of fine-tunes of it); any other kind takes one of its experts (`expert:`)."""
    for model in models:
        if model.family.layout is not None and not takes_moes:
            raise MismatchError(
                f"{model.where()} is an MoE ({model.config.get('model_type')}); kind {kind} "
                "reads dense models. Merge fine-tunes of one MoE with kind: merge, or take one "
                f"of its experts as a dense model: {{model: {model.path}, expert: N}}")


def check_assembly(assembly: str, models: list[SourceModel]) -> None:
    """Refuse a source whose family cannot feed `assembly` (architectures/dense.yaml)."""
    for model in models:
        allowed = model.family.assemblies
        if allowed is not None and assembly not in allowed:
            raise MismatchError(
                f"{model.where()} is {model.config.get('model_type')}, which moemerge builds "
                f"into assembly {', '.join(sorted(allowed))} only, not {assembly}"
            )
