"""mergekit parameters in moemerge's terms: method names, the conventions that make a moemerge
merge equal to mergekit's, model references, and parameter settings (scalars, per-layer
gradients, and `filter` conditions, which become `merge.overrides` per role)."""

from __future__ import annotations

from moemerge.errors import RecipeError
from moemerge.merge.registry import REGISTRY

METHODS = {"linear": "average"} | {
    m: m for m in ("task_arithmetic", "ties", "dare_ties", "dare_linear", "breadcrumbs",
                   "breadcrumbs_ties", "della", "della_linear", "sce", "slerp", "multislerp",
                   "karcher", "model_stock", "passthrough")}
UNSUPPORTED_METHODS = {
    "nuslerp": "moemerge has slerp (two models) and multislerp, not nuslerp's row-wise variant",
    "nearswap": "not implemented in moemerge",
    "arcee_fusion": "not implemented in moemerge",
    "ram": "not implemented in moemerge", "ramplus_tl": "not implemented in moemerge",
}
# mergekit's `normalize` default where it differs from moemerge's (true everywhere)
MERGEKIT_NORMALIZE = {"task_arithmetic": False, "dare_linear": False, "dare_ties": False,
                      "breadcrumbs": False, "breadcrumbs_ties": False, "della_linear": False}
RENAMED = {"normalize_weights": "normalize"}  # mergekit name -> moemerge name
DROPPED = {"int8_mask": "a memory option of mergekit (moemerge computes in float32)"}
# a mergekit `filter` is a substring of the tensor name; these map onto moemerge's roles
# exactly (e.g. "layernorm" is refused: it matches the layers' norms but not the final one)
FILTER_ROLES = {"self_attn": ["attn"], "attn": ["attn"], "mlp": ["ffn"],
                "embed_tokens": ["embed"], "lm_head": ["lm_head"], "norm": ["norm"]}


def moemerge_method(name: str) -> str:
    if name in METHODS:
        return METHODS[name]
    why = UNSUPPORTED_METHODS.get(name, "unknown merge method")
    raise RecipeError(f"merge_method: {name!r} cannot be imported: {why}")


def conventions(method: str, given: dict) -> dict:
    """The options that give mergekit's result, unless the config set them itself."""
    spec = REGISTRY[method]
    out = {}
    if "normalize" in {p.name for p in spec.params} and "normalize" not in given:
        if method in MERGEKIT_NORMALIZE:
            out["normalize"] = MERGEKIT_NORMALIZE[method]
    if spec.param("trim_rounding"):
        out["trim_rounding"] = "floor"
    if spec.param("zero_vote"):
        out["zero_vote"] = "positive"
    if spec.param("rescale"):
        rescale = given.pop("rescale", True)
        out["rescale"] = "l1" if rescale else "none"
    return out


def model_ref(value) -> dict:
    """A mergekit model reference ("path", "path@revision"; "path+lora" is refused)."""
    if isinstance(value, dict):  # {model: ..., lora: ...} or {path: ...}
        if value.get("lora"):
            raise RecipeError("models: LoRA adapters (model+lora) cannot be imported; merge the "
                              "adapter into its model first (peft merge_and_unload)")
        value = value.get("model") or value.get("path")
    text = str(value)
    if "+" in text:
        raise RecipeError(f"models: {text!r} applies a LoRA adapter (model+lora); moemerge "
                          "cannot; merge the adapter into its model first")
    if text.count("@") == 1:
        path, revision = text.split("@")
        return {"model": path, "revision": revision}
    return {"model": text}


def setting(name: str, value, where: str) -> tuple[object, list[tuple[list[str], object]]]:
    """(value for tensors no filter matches, [(roles, value)] for filtered ones, mergekit order:
    the first match wins). A filter-less condition ends the list (later ones never match)."""
    if not isinstance(value, list) or not any(isinstance(v, dict) for v in value):
        return _scalar(value, where), []
    default, filtered = None, []
    for cond in value:
        if not isinstance(cond, dict):
            raise RecipeError(f"{where}: mixes conditions and plain values")
        flt = cond.get("filter")
        if flt in (None, "*"):
            default = _scalar(cond.get("value"), where)
            break
        if flt not in FILTER_ROLES:
            raise RecipeError(f"{where}: filter {flt!r} matches no moemerge role; importable "
                              f"filters: {', '.join(FILTER_ROLES)}")
        filtered.append((FILTER_ROLES[flt], _scalar(cond.get("value"), where)))
    return default, filtered


def _scalar(value, where: str):
    if isinstance(value, list):
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            raise RecipeError(f"{where}: a gradient of non-numbers ({value!r}) cannot be "
                              "imported")
        return [float(v) for v in value]
    return value


def as_overrides(name: str, filtered: list[tuple[list[str], object]]) -> list[dict]:
    """mergekit's first match wins, moemerge's last override wins: reverse the order."""
    return [{"roles": roles, name: value} for roles, value in reversed(filtered)]
