"""mergekit parameters in moemerge's terms: method names, the conventions that make a moemerge
merge equal to mergekit's, model references, and parameter settings (scalars, per-layer
gradients, and `filter` conditions, which become `merge.overrides` selecting `tensors` by the
same name substring)."""

from __future__ import annotations

from moemerge.errors import RecipeError
from moemerge.merge.registry import REGISTRY, per_model_params

METHODS = {"linear": "average"} | {
    m: m for m in ("task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs",
                   "breadcrumbs_ties", "della", "della_linear", "sce", "slerp", "multislerp",
                   "karcher", "model_stock", "passthrough", "nuslerp", "nearswap",
                   "arcee_fusion", "ram", "ramplus_tl")}
# mergekit's `normalize` default where it differs from moemerge's (true everywhere)
MERGEKIT_NORMALIZE = {"task_arithmetic": False, "dare_linear": False, "dare_ties": False,
                      "breadcrumbs": False, "breadcrumbs_ties": False, "della_linear": False}
RENAMED = {"normalize_weights": "normalize"}  # mergekit name -> moemerge name
# per method, where moemerge's name of the parameter differs (the mergekit name means another
# thing in another moemerge method: slerp's t, DELLA's per-model epsilon)
METHOD_RENAMED = {"nearswap": {"t": "swap_distance"},
                  "ram": {"epsilon": "nonzero_threshold"},
                  "ramplus_tl": {"epsilon": "nonzero_threshold"}}
DROPPED = {"int8_mask": "a memory option of mergekit (moemerge computes in float32)"}
# mergekit's defaults of its per-model parameters where moemerge's differ (density 0.7 or 0.9;
# gamma and epsilon are written with them); passthrough's scale defaults to 1 in both
PER_MODEL_DEFAULTS = {"density": 1.0, "gamma": 0.01, "epsilon": 0.15}
PER_MODEL = ("weight", *per_model_params())  # the names mergekit may read per model
ANY = (None, "*", "")  # filters that match every tensor ("" is a substring of every name)


def read_per_model(method: str) -> tuple[str, ...]:
    """The parameters mergekit reads per model for this method (its `tensor_parameters`): the
    models' weight where the method weighs them (not karcher: mergekit's weighs every model
    the same), and the registry's per-model parameters, which mirror mergekit's."""
    spec = REGISTRY[method]
    weight = ("weight",) if spec.weights and spec.target and method != "karcher" else ()
    return weight + spec.per_model


def moemerge_method(name: str) -> str:
    if name in METHODS:
        return METHODS[name]
    raise RecipeError(f"merge_method: {name!r} cannot be imported: not a merge method of "
                      "mergekit 0.1.5 that moemerge knows")


def moemerge_param(method: str, name: str) -> str:
    """moemerge's name of mergekit's global parameter `name` of `method`."""
    return METHOD_RENAMED.get(method, {}).get(name, RENAMED.get(name, name))


def conventions(method: str, given: dict) -> dict:
    """The options that give mergekit's result, unless the config set them itself."""
    spec = REGISTRY[method]
    out = {}
    if "normalize" in {p.name for p in spec.params} and "normalize" not in given:
        if method in MERGEKIT_NORMALIZE:
            out["normalize"] = MERGEKIT_NORMALIZE[method]
    if spec.param("trim_rounding"):
        out["trim_rounding"] = "sort"  # exactly mergekit's entries, ties at the cut-off too
    if spec.param("zero_vote"):
        out["zero_vote"] = "positive"
    if spec.param("rescale"):
        rescale = given.pop("rescale", True)
        out["rescale"] = "l1" if rescale else "none"
    return out


def model_ref(value) -> dict:
    """A mergekit model reference: "path", "path@revision", "path+lora" (a LoRA adapter
    applied to the model, each side with its own @revision), or its dict form ({model, lora},
    each a path or {path, revision})."""
    if isinstance(value, dict):
        lora = value.get("lora")
        out = _path(value.get("model") or value.get("path"), "model")
        if lora:
            adapter = _path(lora, "lora")
            out["lora"] = adapter["model"]
            if "revision" in adapter:
                out["lora_revision"] = adapter["revision"]
        return out
    text = str(value)
    chunks = text.split("+")
    if len(chunks) > 2:
        raise RecipeError(f"models: {text!r}: mergekit reads one '+' (model+lora)")
    out = _path(chunks[0], "model")
    if len(chunks) == 2:
        adapter = _path(chunks[1], "lora")
        out["lora"] = adapter["model"]
        if "revision" in adapter:
            out["lora_revision"] = adapter["revision"]
    return out


def _path(value, what: str) -> dict:
    """mergekit's ModelPath: "path", "path@revision" or {path, revision}, as {model, revision}."""
    if isinstance(value, dict):
        path, revision = value.get("path"), value.get("revision")
    else:
        path, revision = str(value), None
        if path.count("@") > 1:
            raise RecipeError(f"models: {path!r}: mergekit reads one '@' (path@revision)")
        if path.count("@") == 1:
            path, revision = path.split("@")
    if not path:
        raise RecipeError(f"models: a reference without its {what} path")
    return {"model": path, **({"revision": revision} if revision else {})}


def conditions(value, where: str) -> list[dict]:
    """A mergekit parameter setting (a scalar, a gradient, one `{filter, value}` condition or a
    list of them) as a list of conditions; [] when absent."""
    if value is None:
        return []
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        if not all(isinstance(v, dict) for v in value):
            raise RecipeError(f"{where}: mixes conditions and plain values")
        return [dict(v) for v in value]
    return [{"value": value}]


def chain(*scopes: list[dict]) -> list[dict]:
    """mergekit's precedence for one tensor: the conditions of each scope in turn (a model's
    own, then the global `parameters`, then the default), first match wins; a scope whose
    filters all miss falls through to the next. Ends at the first filter-less condition."""
    out: list[dict] = []
    for scope in scopes:
        for cond in scope:
            out.append(cond)
            if cond.get("filter") in ANY:
                return out
    return out


def is_filtered(conds: list[dict]) -> bool:
    return any(c.get("filter") not in ANY for c in conds)


def own_setting(conds: list[dict], where: str) -> object:
    """A model's own setting in moemerge's form: a number or a gradient as it is, else its
    conditions in order, each filter a tensor-name substring (mergekit's first match wins, as
    in moemerge's per-model conditions)."""
    if len(conds) == 1 and not is_filtered(conds):
        return _scalar(conds[0].get("value"), where)
    out = []
    for cond in conds:
        flt, value = cond.get("filter"), _scalar(cond.get("value"), where)
        if flt not in ANY and not isinstance(flt, str):
            raise RecipeError(f"{where}: filter {flt!r} is not a tensor-name substring")
        out.append({"value": value} if flt in ANY else {"tensors": [flt], "value": value})
    return out


def check_source_filters(conds: list[dict], where: str) -> None:
    """In `slices` mergekit matches a per-model setting's filters against the source's tensor
    names, moemerge against the output's: the same tensors when the filter holds no digit
    (the names differ only in the layer number); one with a digit is refused."""
    for cond in conds:
        flt = cond.get("filter")
        if isinstance(flt, str) and any(ch.isdigit() for ch in flt):
            raise RecipeError(f"{where}: filter {flt!r} holds a digit: mergekit matches it "
                              "against the source's layer names, moemerge against the output's, "
                              "so a filtered per-source setting with a layer number cannot be "
                              "imported")


def carry(merge: dict, name: str, conds: list[dict], where: str) -> None:
    """Write a setting into the `merge` block: the filter-less value at the top, each filter as
    an override selecting tensors by that name substring (mergekit's filter, exactly), in
    reverse order: mergekit's first match wins, moemerge's last override."""
    filtered = []
    for cond in conds:
        flt = cond.get("filter")
        if flt in ANY:
            merge[name] = _scalar(cond.get("value"), where)
            break
        if not isinstance(flt, str):
            raise RecipeError(f"{where}: filter {flt!r} is not a tensor-name substring")
        filtered.append({"tensors": [flt], name: _scalar(cond.get("value"), where)})
    if filtered:
        merge.setdefault("overrides", []).extend(reversed(filtered))


def _scalar(value, where: str):
    if isinstance(value, list):
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            raise RecipeError(f"{where}: a gradient of non-numbers ({value!r}) cannot be "
                              "imported")
        try:
            return [float(v) for v in value]
        except OverflowError:
            raise RecipeError(f"{where}: a gradient value is too large for a float") from None
    return value
