"""A mergekit-yaml config (`mergekit-yaml CONFIG OUT`) as a `kind: merge` recipe."""

from __future__ import annotations

from dataclasses import dataclass

from moemerge.errors import RecipeError
from moemerge.merge.registry import REGISTRY
from moemerge.recipe.mergekit.params import (
    DROPPED,
    PER_MODEL,
    PER_MODEL_DEFAULTS,
    carry,
    chain,
    check_source_filters,
    conditions,
    conventions,
    model_ref,
    moemerge_method,
    moemerge_param,
    own_setting,
    read_per_model,
)
from moemerge.recipe.mergekit.problems import Problems

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

    def entry(self) -> dict:
        return {**self.ref, **({"layers": self.layers} if self.layers is not None else {})}


def convert_yaml(data: dict, notes: list[str]) -> dict:
    problems = Problems()
    with problems.check():
        unknown = sorted(set(data) - KEYS)
        if unknown:
            raise RecipeError(f"{', '.join(unknown)}: not a mergekit-yaml key moemerge knows")
    with problems.check():
        if data.get("modules"):
            raise RecipeError("modules: per-module configs (multimodal models) cannot be "
                              "imported")
    with problems.check():
        if data.get("tokenizer") and data.get("tokenizer_source"):
            raise RecipeError("tokenizer_source: give it or `tokenizer:`, not both (as mergekit)")
    with problems.check():
        dtype = data.get("out_dtype") or data.get("dtype")
        if dtype and dtype not in DTYPES:
            raise RecipeError(f"dtype: {dtype!r} is not one of {', '.join(sorted(DTYPES))}")
    with problems.check():
        method = moemerge_method(data.get("merge_method", ""))
    problems.raise_any()  # what follows needs the method
    spec = REGISTRY[method]
    base = model_ref(data["base_model"]) if data.get("base_model") else None
    merge: dict = {"method": method}
    shared: dict = {}  # the global settings of per-model parameters (weight, density, ...)
    for name, value in (data.get("parameters") or {}).items():
        name, where = moemerge_param(method, name), f"parameters.{name}"
        if name in DROPPED:
            notes.append(f"{where}: not carried: {DROPPED[name]}")
        elif name == "eps" and method == "multislerp":
            notes.append(f"{where}: not carried: moemerge's multislerp uses eps 1e-8")
        elif name in PER_MODEL:
            shared[name] = value
        elif spec.param(name) is None:
            problems.found.append(
                f"{where}: {method} in moemerge takes no {name!r} (it takes "
                f"{', '.join(p.name for p in spec.params) or 'no parameters'})")
        else:
            with problems.check():
                carry(merge, name, conditions(value, where), where)
    recipe: dict = {"kind": "merge"}
    if data.get("name"):
        recipe["name"] = data["name"]
    sliced = bool(data.get("slices"))
    if sliced:
        slices = problems.each(data["slices"], lambda i, s: _slice(s, i, base, spec, notes))
        inputs = [i for s in slices for i in s]
    else:
        inputs = _models(data.get("models") or [], base, spec, notes)
    entries = problems.each(inputs, lambda _, i: _entry(i, shared, method, sliced, notes))
    problems.raise_any()
    if sliced:
        counts = iter(entries)
        recipe["slices"] = [{"sources": [next(counts) for _ in s]} for s in slices]
    else:
        recipe["models"] = entries
    for name in sorted(set(shared) - set(read_per_model(method))):
        notes.append(f"parameters.{name}: not carried: {method} takes no {name} (mergekit "
                     "ignores it too)")
    for name in read_per_model(method):
        if name != "weight":
            _per_model(name, inputs, entries, shared, merge, sliced)
    merge.update(conventions(method, merge))
    if base is not None and spec.base != "ignored":
        recipe["base_model"] = base
    elif base is not None:
        notes.append(f"base_model: {method} takes no base; it is one of the merged models")
    recipe["merge"] = merge
    dtype = data.get("out_dtype") or data.get("dtype")
    if dtype:
        recipe["output"] = {"dtype": dtype}
    if data.get("dtype") not in (None, "float32"):
        notes.append(f"dtype: mergekit computes in {data['dtype']}; moemerge always computes "
                     "in float32 and casts once on write (a rounding-level difference)")
    tokenizer = _tokenizer(data, notes)
    if tokenizer is not None:
        recipe["tokenizer"] = tokenizer
    return recipe


def _entry(inp: Input, shared: dict, method: str, sliced: bool, notes: list[str]) -> dict:
    """The recipe's entry of one input with its weight: its own, else `parameters.weight`
    (moemerge's merge block has no weight); a per-model parameter the method does not read
    is noted."""
    entry = inp.entry()
    read = read_per_model(method)
    for name in sorted(set(inp.params) - set(read)):
        notes.append(f"{inp.where}.parameters.{name}: not carried: mergekit's {method} ignores "
                     f"a per-model {name} (so does the recipe)")
    if "weight" in read:
        weight = chain(_own(inp, "weight", sliced), _global(shared, "weight", sliced))
        if weight:
            entry["weight"] = own_setting(weight, f"{inp.where}.parameters.weight")
    return entry


def _per_model(name: str, inputs: list[Input], entries: list[dict], shared: dict, merge: dict,
               sliced: bool) -> None:
    """mergekit resolves density, gamma, epsilon and scale per model: its own setting, else
    the global one, else the default. When every model resolves to the same setting it goes
    into the merge block (where `--tune-on` varies it); else each model's own goes into its
    entry, with the global setting and mergekit's default behind them in the merge block."""
    default = [{"value": PER_MODEL_DEFAULTS[name]}] if name in PER_MODEL_DEFAULTS else []
    fallback = chain(_global(shared, name, sliced), default)
    owns = [_own(inp, name, sliced) for inp in inputs]
    resolved = [chain(own, fallback) for own in owns]
    if all(r == resolved[0] for r in resolved):
        carry(merge, name, resolved[0], f"parameters.{name}")
        return
    carry(merge, name, fallback, f"parameters.{name}")
    for inp, entry, own in zip(inputs, entries, owns, strict=True):
        if own:
            entry[name] = own_setting(own, f"{inp.where}.parameters.{name}")


def _own(inp: Input, name: str, sliced: bool) -> list[dict]:
    where = f"{inp.where}.parameters.{name}"
    conds = conditions(inp.params.get(name), where)
    if sliced:
        check_source_filters(conds, where)
    return conds


def _global(shared: dict, name: str, sliced: bool) -> list[dict]:
    where = f"parameters.{name}"
    conds = conditions(shared.get(name), where)
    if sliced:  # a per-model parameter's global setting is matched like the model's own
        check_source_filters(conds, where)
    return conds


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


def _tokenizer(data: dict, notes: list[str]) -> dict | None:
    """mergekit's `tokenizer_source` / `tokenizer:` as the recipe's `tokenizer:` block (the
    same vocabulary, rows and added tokens: plan/tokens.py); None without either, where both
    tools keep the base's (or first model's) vocabulary as it is."""
    if data.get("chat_template"):
        notes.append("chat_template: not carried: set it in the output's tokenizer_config.json")
    given = data.get("tokenizer")
    if given is None and data.get("tokenizer_source") is None:
        return None
    if given is None:
        given = {"source": data["tokenizer_source"]}
    if not isinstance(given, dict):
        raise RecipeError("tokenizer: a mapping with source, tokens, pad_to_multiple_of")
    unknown = sorted(set(given) - {"source", "tokens", "pad_to_multiple_of"})
    if unknown:
        raise RecipeError(f"tokenizer.{unknown[0]}: not a key of mergekit's tokenizer config")
    source = given.get("source", "union")
    out: dict = {"source": source if source in ("union", "base") else model_ref(source)["model"]}
    tokens = _tokens(given.get("tokens") or {})
    if tokens:
        out["tokens"] = tokens
    if given.get("pad_to_multiple_of") is not None:
        out["pad_to_multiple_of"] = given["pad_to_multiple_of"]
    return out


def _tokens(given: object) -> dict[str, dict]:
    """`tokenizer.tokens`: each token a non-empty string, given once (`1:` and `"1":` are the
    same token to a tokenizer; YAML's own repeated keys are refused as the file is read)."""
    if not isinstance(given, dict):
        raise RecipeError("tokenizer.tokens: a mapping of tokens to {source, force}")
    tokens: dict[str, dict] = {}
    for token, entry in given.items():
        if token is None or token == "":
            raise RecipeError("tokenizer.tokens: an empty token (\"\"); a token added to the "
                              "vocabulary is at least one character")
        text = str(token)
        if text in tokens:
            raise RecipeError(f"tokenizer.tokens.{text[:80]}: the token is listed twice "
                              f"({text[:80]!r}); list each token once")
        tokens[text] = _token_source(text, entry)
    return tokens


def _token_source(token: str, entry) -> dict:
    """One `tokens:` entry: {source: {kind: zero} | {kind: model_token, model, token |
    token_id} | model, force}."""
    where = f"tokenizer.tokens.{token}"
    if not isinstance(entry, dict):
        raise RecipeError(f"{where}: a mapping with source and force")
    out: dict = {"force": bool(entry.get("force", False))}
    source = entry.get("source")
    if isinstance(source, dict) and source.get("kind") == "zero":
        out["source"] = "zero"
    elif isinstance(source, dict) and source.get("kind") == "model_token":
        out["source"] = {"model": model_ref(source["model"])["model"],
                         **{k: source[k] for k in ("token", "token_id") if source.get(k)
                            is not None}}
    elif source is not None:
        out["source"] = model_ref(source)["model"]
    return out
