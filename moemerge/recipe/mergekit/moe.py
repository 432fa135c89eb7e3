"""A mergekit-moe config (`mergekit-moe CONFIG OUT`) as a token-routed `kind: moe` recipe.

mergekit-moe copies attention, embeddings and norms from the base model (`merge: {method:
base}` here) and keeps each expert's FFN; its gate modes map onto router inits."""

from __future__ import annotations

from moemerge.errors import RecipeError
from moemerge.recipe.mergekit.params import model_ref
from moemerge.recipe.mergekit.problems import Problems

KEYS = {"base_model", "experts", "gate_mode", "dtype", "experts_per_token", "shared_experts",
        "architecture", "tokenizer", "tokenizer_source", "name"}
# mergekit-moe's gate modes as moemerge router inits that compute them as mergekit does
GATES = {"hidden": "mergekit_hidden", "hidden_last": "mergekit_hidden",
         "hidden_avg": "mergekit_hidden_avg", "cheap_embed": "mergekit_cheap_embed",
         "random": "random", "uniform_random": "uniform"}
# mergekit-moe's `architecture:` (a prefix of its output's name) as moemerge layouts; None:
# the base family's own (with a shared expert: DeepSeek-MoE for Llama / Mistral, as mergekit
# picks it first, Qwen2-MoE for Qwen2)
ARCHITECTURES = {None: None, "mixtral": "mixtral", "deepseek": "deepseek", "qwen": None,
                 "qwen3": "qwen3_moe"}


def convert_moe(data: dict, notes: list[str]) -> dict:
    problems = Problems()
    with problems.check():
        unknown = sorted(set(data) - KEYS)
        if unknown:
            raise RecipeError(f"{', '.join(unknown)}: not a mergekit-moe key moemerge knows")
    with problems.check():
        if data.get("tokenizer"):
            raise RecipeError("tokenizer: vocabulary surgery cannot be imported")
    gate = data.get("gate_mode", "hidden")
    with problems.check():
        if gate not in GATES:
            raise RecipeError(f"gate_mode: {gate!r} is not one of {', '.join(GATES)}")
    experts = problems.each(data.get("experts") or [], lambda i, e: _expert(e, i))
    architecture = data.get("architecture")
    if isinstance(architecture, str):
        architecture = architecture.lower()
    with problems.check():
        if architecture not in ARCHITECTURES:
            raise RecipeError(f"architecture: {data['architecture']!r} is not one of "
                              "mergekit-moe's outputs moemerge writes: "
                              + ", ".join(a for a in ARCHITECTURES if a))
        shared, layout = _shared_expert(data, architecture)
    problems.raise_any()
    router: dict = {"init": GATES[gate]}
    if gate == "random":
        router["std"] = 1.0
        notes.append("router: mergekit-moe's random gates are N(0, 1); kept with router.std 1.0 "
                     "(moemerge's default, the model's initializer_range, routes near-uniformly "
                     "instead of saturating); the draws differ")
    if gate == "uniform_random":
        notes.append("router: mergekit-moe's uniform_random gates are U(-1/√H, 1/√H), "
                     "router.init uniform; the draws differ")
    elif gate != "random":
        own = "prompts" if gate.startswith("hidden") else "cheap_embed"
        notes.append(f"router.init {GATES[gate]}: mergekit-moe's gate_mode {gate}, computed as "
                     f"it computes it; moemerge's own init from the same prompts is {own} "
                     "(the FFN's input over every token, centred across experts: "
                     "docs/routing.md)")
    recipe: dict = {"kind": "moe", "assembly": "token_routed"}
    if data.get("name"):
        recipe["name"] = data["name"]
    recipe["base_model"] = model_ref(data["base_model"])
    recipe["experts"] = experts
    recipe["experts_per_token"] = _experts_per_token(data.get("experts_per_token", 2))
    if shared is not None:
        recipe["shared_expert"] = shared
    if layout is not None:
        recipe["layout"] = layout
    recipe["merge"] = {"method": "base"}
    recipe["router"] = router
    if data.get("dtype"):
        recipe["output"] = {"dtype": data["dtype"]}
    if data.get("tokenizer_source") not in (None, "base"):
        notes.append(f"tokenizer_source: not carried: moemerge copies the base model's "
                     f"tokenizer, not {data['tokenizer_source']!r}")
    notes.append("output: moemerge writes the classic per-expert tensor names that transformers "
                 "4 and 5 load and llama.cpp's converter reads (mergekit-moe writes "
                 "transformers-5 fused names) and config.json with rope_theta and torch_dtype")
    return recipe


def _shared_expert(data: dict, architecture: str | None) -> tuple[dict | None, str | None]:
    """(the recipe's shared_expert, its layout) from `shared_experts` and `architecture`, as
    mergekit-moe picks its output: DeepSeek-MoE when the shared expert has no prompts (its
    shared FFN is ungated), Qwen2-MoE when it has (its gate is set from them)."""
    layout = ARCHITECTURES[architecture]
    found = data.get("shared_experts") or []
    if not isinstance(found, list) or len(found) > 1:
        raise RecipeError("shared_experts: mergekit-moe writes at most one shared expert (its "
                          "DeepSeek and Qwen outputs refuse more); give one")
    if not found:
        return None, layout
    if architecture in ("mixtral", "qwen3"):
        raise RecipeError(f"shared_experts: mergekit-moe's {architecture} output has no shared "
                          "expert; use architecture: deepseek or qwen, or remove shared_experts")
    shared = _expert(found[0], 0, "shared_experts")
    prompted = bool(shared.get("positive_prompts"))
    if architecture == "deepseek" and prompted:
        raise RecipeError("shared_experts.0.positive_prompts: mergekit-moe's DeepSeek output "
                          "adds its shared expert ungated, so prompts set nothing; remove them, "
                          "or use architecture: qwen (a gate set from them)")
    if architecture == "qwen" and not prompted and data.get("gate_mode") != "random":
        raise RecipeError("shared_experts.0: mergekit-moe's Qwen output sets the shared "
                          "expert's gate from its positive_prompts; give some, or use "
                          "architecture: deepseek (an ungated shared expert)")
    if architecture == "qwen" or prompted:
        layout = "qwen2_moe"
    return shared, layout


def _expert(data: dict, i: int, field: str = "experts") -> dict:
    where = f"{field}.{i}"
    extra = sorted(set(data) - {"source_model", "positive_prompts", "negative_prompts",
                                "noise_scale", "residual_scale"})
    if extra:
        raise RecipeError(f"{where}: {', '.join(extra)}: not a mergekit-moe expert key")
    out = model_ref(data["source_model"])
    for key in ("positive_prompts", "negative_prompts"):
        if data.get(key):
            out[key] = list(data[key])
    for key in ("noise_scale", "residual_scale"):  # the same fields (noise: other draws)
        if data.get(key) is not None:
            out[key] = data[key]
    return out


def _experts_per_token(value: object) -> int:
    """A whole number of experts (mergekit-moe writes 2 or 2.0), at least 1; anything else
    (inf, NaN, 1e400, a string, a bool) is an error naming the key."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RecipeError(f"experts_per_token: must be a whole number of experts, at least 1, "
                          f"got {str(value)[:40]!r}")
    return value
