"""A mergekit-yaml config (`mergekit-yaml CONFIG OUT`) as a `kind: merge` recipe."""

from __future__ import annotations

from moemerge.errors import RecipeError
from moemerge.merge.registry import REGISTRY
from moemerge.recipe.mergekit.params import (
    DROPPED,
    RENAMED,
    as_overrides,
    conventions,
    model_ref,
    moemerge_method,
    setting,
)

KEYS = {"merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype",
        "tokenizer_source", "tokenizer", "chat_template", "name", "modules"}
PER_MODEL = ("density", "gamma", "epsilon")  # one value per tensor group in moemerge
DTYPES = {"float32", "float16", "bfloat16"}


def convert_yaml(data: dict, notes: list[str]) -> dict:
    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise RecipeError(f"{', '.join(unknown)}: not a mergekit-yaml key moemerge knows")
    if data.get("modules"):
        raise RecipeError("modules: per-module configs (multimodal models) cannot be imported")
    if data.get("tokenizer"):
        raise RecipeError("tokenizer: mergekit's vocabulary surgery (added tokens, union "
                          "vocabularies) cannot be imported; moemerge merges one vocabulary")
    method = moemerge_method(data.get("merge_method", ""))
    spec = REGISTRY[method]
    base = model_ref(data["base_model"]) if data.get("base_model") else None
    merge: dict = {"method": method}
    per_model: dict = {}
    for name, value in (data.get("parameters") or {}).items():
        _global(spec, RENAMED.get(name, name), value, merge, per_model, notes)
    recipe: dict = {"kind": "merge"}
    if data.get("name"):
        recipe["name"] = data["name"]
    if data.get("slices"):
        recipe["slices"] = [_slice(s, i, base, spec, per_model) for i, s in
                            enumerate(data["slices"])]
    else:
        recipe["models"] = _models(data.get("models") or [], base, spec, per_model)
    if method == "karcher":  # mergekit's karcher weighs every input equally
        weighted = [m for m in recipe.get("models", []) if m.pop("weight", None) is not None]
        if weighted:
            notes.append("weight: not carried: mergekit's karcher ignores the models' weights "
                         "(moemerge's would use them)")
    merge.update({k: v for k, v in per_model.items() if k != "weight"})
    merge.update(conventions(method, merge))
    if base is not None and spec.base != "ignored":
        recipe["base_model"] = base
    elif base is not None:
        notes.append(f"base_model: {method} takes no base; it is one of the merged models")
    recipe["merge"] = merge
    dtype = data.get("out_dtype") or data.get("dtype")
    if dtype:
        if dtype not in DTYPES:
            raise RecipeError(f"dtype: {dtype!r} is not one of {', '.join(sorted(DTYPES))}")
        recipe["output"] = {"dtype": dtype}
    if data.get("dtype") not in (None, "float32"):
        notes.append(f"dtype: mergekit computes in {data['dtype']}; moemerge always computes "
                     "in float32 and casts once on write (a rounding-level difference)")
    _tokenizer(data, base, notes)
    return recipe


def _global(spec, name, value, merge, per_model, notes) -> None:
    where = f"parameters.{name}"
    if name in DROPPED:
        notes.append(f"{where}: not carried: {DROPPED[name]}")
        return
    if name == "eps" and spec.name == "multislerp":
        notes.append(f"{where}: not carried: moemerge's multislerp uses eps 1e-8")
        return
    if name in ("weight", *PER_MODEL):
        default, filtered = setting(name, value, where)
        if filtered or isinstance(default, list):
            raise RecipeError(f"{where}: a filtered or per-layer {name} cannot be imported "
                              "(moemerge has one per model)" if name == "weight" else
                              f"{where}: filtered per-model parameters cannot be imported")
        per_model.setdefault(name, default)
        return
    if name not in {p.name for p in spec.params}:
        raise RecipeError(f"{where}: {spec.name} in moemerge takes no {name!r} (it takes "
                          f"{', '.join(p.name for p in spec.params) or 'no parameters'})")
    default, filtered = setting(name, value, where)
    if default is not None:
        merge[name] = default
    if filtered:
        merge.setdefault("overrides", []).extend(as_overrides(name, filtered))


def _model_params(entry: dict, where: str, per_model: dict, seen: dict) -> float | None:
    """The entry's weight; its density, gamma, epsilon must equal every other model's."""
    params = dict(entry.get("parameters") or {})
    weight = params.pop("weight", per_model.get("weight"))
    if isinstance(weight, list):
        raise RecipeError(f"{where}.parameters.weight: a filtered or per-layer weight cannot "
                          "be imported (moemerge has one weight per model)")
    for name, value in params.items():
        if name not in PER_MODEL:
            raise RecipeError(f"{where}.parameters.{name}: a per-model {name} cannot be "
                              "imported")
        if isinstance(value, list | dict):
            raise RecipeError(f"{where}.parameters.{name}: a filtered or per-layer per-model "
                              "value cannot be imported")
        if seen.setdefault(name, value) != value:
            raise RecipeError(f"{where}.parameters.{name}: {value} differs from another "
                              f"model's {seen[name]}; moemerge takes one {name} for all models")
    return weight


def _models(entries: list, base, spec, per_model) -> list[dict]:
    seen: dict = {}
    out = []
    for i, entry in enumerate(entries):
        entry = entry if isinstance(entry, dict) else {"model": entry}
        ref = model_ref(entry["model"])
        weight = _model_params(entry, f"models.{i}", per_model, seen)
        if base is not None and ref == base and spec.base != "ignored":
            continue  # mergekit's base is the reference, never a merged input
        out.append({**ref, **({"weight": weight} if weight is not None else {})})
    if base is not None and spec.base == "ignored" and base not in [
            {k: v for k, v in r.items() if k != "weight"} for r in out]:
        out.insert(0, dict(base))  # mergekit adds the base to the inputs
    if spec.name == "slerp" and base is not None:  # t = 0 is the base: it goes first
        out.sort(key=lambda r: {k: v for k, v in r.items() if k != "weight"} != base)
    per_model.update({k: v for k, v in seen.items()})
    return out


def _slice(data: dict, i: int, base, spec, per_model) -> dict:
    where = f"slices.{i}"
    extra = sorted(set(data) - {"sources"})
    if extra:
        raise RecipeError(f"{where}: per-slice {', '.join(extra)} cannot be imported")
    seen: dict = {}
    sources = []
    for j, src in enumerate(data.get("sources") or []):
        ref = model_ref(src["model"])
        weight = _model_params(src, f"{where}.sources.{j}", per_model, seen)
        if base is not None and ref == base and spec.base not in ("ignored",) and len(
                data["sources"]) > 1 and spec.name != "slerp":
            continue
        sources.append({**ref, "layers": list(src["layer_range"]),
                        **({"weight": weight} if weight is not None else {})})
    if spec.name == "slerp" and base is not None:
        sources.sort(key=lambda s: {k: s[k] for k in s if k in ("model", "revision")} != base)
    per_model.update(seen)
    return {"sources": sources}


def _tokenizer(data: dict, base, notes: list[str]) -> None:
    source = data.get("tokenizer_source")
    if source == "union":
        raise RecipeError("tokenizer_source: 'union' builds a new vocabulary; moemerge merges "
                          "models of one vocabulary and cannot import it")
    if source not in (None, "base") and (base is None or model_ref(source) != base):
        notes.append(f"tokenizer_source: not carried: moemerge copies the tokenizer of the "
                     f"base (or first) model, not {source!r}; copy it into the output yourself")
    if data.get("chat_template"):
        notes.append("chat_template: not carried: set it in the output's tokenizer_config.json")
