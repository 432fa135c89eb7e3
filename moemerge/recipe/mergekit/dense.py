"""A mergekit-yaml config (`mergekit-yaml CONFIG OUT`) as a `kind: merge` recipe."""

from __future__ import annotations

from dataclasses import dataclass

from moemerge.errors import RecipeError
from moemerge.merge.registry import REGISTRY
from moemerge.recipe.mergekit.params import (
    DROPPED,
    PER_MODEL_DEFAULTS,
    RENAMED,
    carry,
    chain,
    conditions,
    conventions,
    is_filtered,
    model_ref,
    moemerge_method,
    shown,
)

KEYS = {"merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype",
        "tokenizer_source", "tokenizer", "chat_template", "name", "modules"}
DTYPES = {"float32", "float16", "bfloat16"}


@dataclass
class Input:
    """One merged model (or slice source) and its own mergekit parameters."""

    where: str  # "models.1", "slices.0.sources.1"
    ref: dict
    params: dict
    layers: list | None = None

    def entry(self, weight) -> dict:
        out = {**self.ref, **({"layers": self.layers} if self.layers is not None else {})}
        return {**out, **({"weight": weight} if weight is not None else {})}


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
    shared: dict = {}  # the global settings of per-model parameters (weight, density, ...)
    for name, value in (data.get("parameters") or {}).items():
        name, where = RENAMED.get(name, name), f"parameters.{name}"
        if name in DROPPED:
            notes.append(f"{where}: not carried: {DROPPED[name]}")
        elif name == "eps" and method == "multislerp":
            notes.append(f"{where}: not carried: moemerge's multislerp uses eps 1e-8")
        elif name == "weight" or name in PER_MODEL_DEFAULTS:
            shared[name] = value
        elif spec.param(name) is None:
            raise RecipeError(f"{where}: {method} in moemerge takes no {name!r} (it takes "
                              f"{', '.join(p.name for p in spec.params) or 'no parameters'})")
        else:
            carry(merge, name, conditions(value, where), where)
    recipe: dict = {"kind": "merge"}
    if data.get("name"):
        recipe["name"] = data["name"]
    if data.get("slices"):
        slices = [_slice(s, i, base, spec, notes) for i, s in enumerate(data["slices"])]
        inputs = [i for s in slices for i in s]
        recipe["slices"] = [{"sources": [_entry(i, shared, method) for i in s]} for s in slices]
    else:
        inputs = _models(data.get("models") or [], base, spec, notes)
        recipe["models"] = [_entry(i, shared, method) for i in inputs]
    if method == "karcher":  # mergekit's karcher weighs every input equally
        weighted = [m for m in recipe.get("models", []) if m.pop("weight", None) is not None]
        if weighted:
            notes.append("weight: not carried: mergekit's karcher ignores the models' weights "
                         "(moemerge's would use them)")
    for name, default in PER_MODEL_DEFAULTS.items():
        _per_model(name, default, inputs, shared, method, merge, notes, bool(data.get("slices")))
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


def _entry(inp: Input, shared: dict, method: str) -> dict:
    """The recipe's entry of one input, with its weight: its own, else `parameters.weight`."""
    weight = inp.params.get("weight", shared.get("weight"))
    if isinstance(weight, list | dict):
        raise RecipeError(f"{inp.where}.parameters.weight: a filtered or per-layer weight cannot "
                          f"be imported (moemerge has one weight per model)")
    return inp.entry(weight)


def _per_model(name: str, default: float, inputs: list[Input], shared: dict, method: str,
               merge: dict, notes: list[str], slices: bool) -> None:
    """mergekit resolves density, gamma and epsilon per model (its own setting, else the
    global one, else the default); moemerge has one per tensor: carried when every merged
    model resolves to the same setting, else refused (never one model's value for all)."""
    given = [i.where for i in inputs if name in i.params] + (
        [f"parameters.{name}"] if name in shared else [])
    if REGISTRY[method].param(name) is None:
        if given:
            notes.append(f"{given[0]}: not carried: {method} takes no {name} (mergekit ignores "
                         "it too)")
        return
    glob = conditions(shared.get(name), f"parameters.{name}")
    settings = []
    for inp in inputs:
        own = conditions(inp.params.get(name), f"{inp.where}.parameters.{name}")
        if slices and is_filtered(own):
            raise RecipeError(f"{inp.where}.parameters.{name}: a filtered per-source setting "
                              "cannot be imported (mergekit matches it against the source's "
                              "layer names, moemerge against the output's)")
        settings.append((inp, chain(own, glob, [{"value": default}])))
    for inp, setting in settings[1:]:
        first, value = settings[0]
        if setting != value:
            raise RecipeError(
                f"{inp.where}.parameters.{name}: {shown(setting)!r} where {first.where} has "
                f"{shown(value)!r}; moemerge applies one {name} to every model (mergekit "
                f"resolves each model's own, else parameters.{name}, else {default:g}), so "
                "this config cannot be imported without changing the model")
    if settings:
        carry(merge, name, settings[0][1], f"{settings[0][0].where}.parameters.{name}")


def _check_params(inp: Input) -> None:
    for name in inp.params:
        if name != "weight" and name not in PER_MODEL_DEFAULTS:
            raise RecipeError(f"{inp.where}.parameters.{name}: a per-model {name} cannot be "
                              "imported")


def _merged(inputs: list[Input], base, spec, notes: list[str], reference: bool) -> list[Input]:
    """The inputs that are merged: not the base when it is the task-vector `reference` (then
    mergekit applies no parameters to it); slerp's base first (t = 0)."""
    out = []
    for inp in inputs:
        if reference and base is not None and inp.ref == base and spec.base != "ignored":
            if inp.params:
                notes.append(f"{inp.where}.parameters: not carried: {spec.name} applies no "
                             "parameters to the base model (nor does mergekit)")
            continue
        _check_params(inp)
        out.append(inp)
    if spec.name == "slerp" and base is not None:
        out.sort(key=lambda i: i.ref != base)
    return out


def _models(entries: list, base, spec, notes: list[str]) -> list[Input]:
    inputs = [Input(f"models.{i}", model_ref(e["model"]), dict(e.get("parameters") or {}))
              for i, e in enumerate(e if isinstance(e, dict) else {"model": e} for e in entries)]
    if base is not None and spec.base == "ignored" and base not in [i.ref for i in inputs]:
        inputs.insert(0, Input("base_model", dict(base), {}))  # mergekit adds it to the inputs
    return _merged(inputs, base, spec, notes, True)


def _slice(data: dict, i: int, base, spec, notes: list[str]) -> list[Input]:
    where = f"slices.{i}"
    extra = sorted(set(data) - {"sources"})
    if extra:
        raise RecipeError(f"{where}: per-slice {', '.join(extra)} cannot be imported")
    sources = data.get("sources") or []
    inputs = [Input(f"{where}.sources.{j}", model_ref(src["model"]),
                    dict(src.get("parameters") or {}), list(src["layer_range"]))
              for j, src in enumerate(sources)]
    # a lone source is the slice's layers themselves (layer stacking), even the base's
    return _merged(inputs, base, spec, notes, len(sources) > 1)


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
