"""The merges benchmarks/mergekit_parity.py builds with both tools, and its results table.

Each case is one merge written twice: a mergekit-yaml config and a moemerge recipe, with the
moemerge options (`options`) that switch its conventions to mergekit's where they differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import yaml

WEIGHTS = (1.0, 0.6, 1.4)


@dataclass(frozen=True)
class Case:
    name: str
    mergekit_method: str
    ours: dict  # the moemerge merge block (method and parameters)
    mk_params: dict = field(default_factory=dict)  # mergekit's global parameters
    mk_model_params: dict = field(default_factory=dict)  # mergekit's per-model parameters
    conventions: dict = field(default_factory=dict)  # moemerge options = mergekit's conventions
    base: bool = True
    weights: bool = True
    models: int = 3
    family: str = "llama"  # of the benchmark's random models

    @property
    def options(self) -> str:
        return ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}"
                         for k, v in self.conventions.items())

    def with_models(self, n: int) -> Case:
        return replace(self, name=f"{self.name}-{n}", models=n)

    def inputs(self, models) -> list:
        return [str(m) for m in models[1:1 + self.models]]

    def mergekit(self, models) -> str:
        entries = []
        for i, m in enumerate(self.inputs(models)):
            params = dict(self.mk_model_params)
            if self.weights:
                params["weight"] = WEIGHTS[i]
            entries.append({"model": m, **({"parameters": params} if params else {})})
        config = {"merge_method": self.mergekit_method, "models": entries, "dtype": "float32"}
        if self.base:
            config["base_model"] = str(models[0])
        if self.mk_params:
            config["parameters"] = self.mk_params
        return yaml.safe_dump(config, sort_keys=False)

    def moemerge(self, models, *, conventions: bool, seed: int = 0) -> str:
        inputs = [{"model": m, **({"weight": WEIGHTS[i]} if self.weights else {})}
                  for i, m in enumerate(self.inputs(models))]
        merge = {**self.ours, **(self.conventions if conventions else {})}
        recipe = {"kind": "merge", "models": inputs, "merge": merge, "seed": seed,
                  "output": {"dtype": "float32"}}
        if self.base:
            recipe["base_model"] = str(models[0])
        return yaml.safe_dump(recipe, sort_keys=False)


@dataclass(frozen=True)
class SliceCase(Case):
    """Layer stacking: base layers [0, 3) then model 1's [1, 4) (passthrough)."""

    def mergekit(self, models) -> str:
        return yaml.safe_dump({"merge_method": "passthrough", "dtype": "float32", "slices": [
            {"sources": [{"model": str(models[0]), "layer_range": [0, 3]}]},
            {"sources": [{"model": str(models[1]), "layer_range": [1, 4]}]}]}, sort_keys=False)

    def moemerge(self, models, *, conventions: bool, seed: int = 0) -> str:
        return yaml.safe_dump({"kind": "merge", "merge": {"method": "passthrough"},
                               "output": {"dtype": "float32"}, "slices": [
            {"model": str(models[0]), "layers": [0, 3]},
            {"model": str(models[1]), "layers": [1, 4]}]}, sort_keys=False)


@dataclass(frozen=True)
class SlerpCase(Case):
    """slerp of models 1 and 2, model 1 mergekit's base (t = 0): mergekit's t setting in
    `mk_params`, moemerge's merge block in `ours`; `slices` writes the mergekit config as the
    README's one slice of every layer, else as `models`."""

    slices: bool = False

    def mergekit(self, models) -> str:
        a, b = str(models[1]), str(models[2])
        inputs = ({"slices": [{"sources": [{"model": a, "layer_range": [0, 4]},
                                           {"model": b, "layer_range": [0, 4]}]}]}
                  if self.slices else {"models": [{"model": a}, {"model": b}]})
        return yaml.safe_dump({"merge_method": "slerp", "base_model": a, "dtype": "float32",
                               **inputs, "parameters": self.mk_params}, sort_keys=False)

    def moemerge(self, models, *, conventions: bool, seed: int = 0) -> str:
        return yaml.safe_dump({"kind": "merge", "models": [str(models[1]), str(models[2])],
                               "output": {"dtype": "float32"}, "merge": self.ours},
                              sort_keys=False)


MK_TIES = {"trim_rounding": "sort", "zero_vote": "positive"}
CASES = [
    Case("linear", "linear", {"method": "average"}, base=False),
    Case("task_arithmetic", "task_arithmetic", {"method": "task_arithmetic", "lambda": 0.7},
         {"lambda": 0.7}, conventions={"normalize": False}),
    Case("ties", "ties", {"method": "ties", "density": 0.55}, mk_model_params={"density": 0.55},
         conventions=MK_TIES),
    Case("ties (normalize false)", "ties", {"method": "ties", "density": 0.55},
         {"normalize": False}, {"density": 0.55}, conventions={**MK_TIES, "normalize": False}),
    Case("breadcrumbs", "breadcrumbs", {"method": "breadcrumbs", "density": 0.8, "gamma": 0.05},
         mk_model_params={"density": 0.8, "gamma": 0.05},
         conventions={"trim_rounding": "sort", "normalize": False}),
    Case("breadcrumbs_ties", "breadcrumbs_ties",
         {"method": "breadcrumbs_ties", "density": 0.8, "gamma": 0.05},
         mk_model_params={"density": 0.8, "gamma": 0.05},
         conventions={**MK_TIES, "normalize": False}),
    Case("sce", "sce", {"method": "sce", "select_topk": 0.5}, {"select_topk": 0.5},
         conventions={"zero_vote": "positive"}, weights=False),
    Case("model_stock", "model_stock", {"method": "model_stock"}, weights=False),
    Case("multislerp (with base)", "multislerp", {"method": "multislerp"}),
    Case("multislerp (no base)", "multislerp", {"method": "multislerp"}, base=False),
    Case("karcher", "karcher", {"method": "karcher"}, base=False, weights=False),
    SlerpCase("slerp (filtered t gradients)", "slerp", {
        "method": "slerp", "t": 0.3, "overrides": [
            {"roles": ["attn"], "t": [0, 0.5, 1]}, {"roles": ["ffn"], "t": [1, 0.5, 0]}]},
        {"t": [{"filter": "self_attn", "value": [0, 0.5, 1]},
               {"filter": "mlp", "value": [1, 0.5, 0]}, {"value": 0.3}]}, slices=True),
    # tensors outside the layers: embeddings, final norm and head all at t = 0 (the first value)
    SlerpCase("slerp (t gradient [0, 1], no filter)", "slerp", {"method": "slerp", "t": [0, 1]},
              {"t": [0, 1]}),
    # mergekit's filter is a substring: "norm" also selects self_attn.q_norm / k_norm
    SlerpCase("slerp (Qwen3, filter norm: q_norm, k_norm too)", "slerp", {
        "method": "slerp", "t": 0.3, "overrides": [{"tensors": ["norm"], "t": [1, 0.2]}]},
        {"t": [{"filter": "norm", "value": [1, 0.2]}, {"value": 0.3}]}, family="qwen3"),
    SliceCase("passthrough (slices 3 + 3 layers)", "passthrough", {"method": "passthrough"}),
    # t = w_2 / (w_1 + w_2) from the weights 1, 0.6
    Case("nuslerp (with base)", "nuslerp", {"method": "nuslerp"}, models=2),
    Case("nuslerp (per row, no base)", "nuslerp", {"method": "nuslerp", "nuslerp_flatten": False},
         {"nuslerp_flatten": False}, base=False, models=2),
    # the noise is N(0, 0.01²): t = 0.01 swaps about 70 % of the entries, steps the rest
    Case("nearswap", "nearswap", {"method": "nearswap", "swap_distance": 0.01}, {"t": 0.01},
         weights=False, models=1),
    Case("arcee_fusion", "arcee_fusion", {"method": "arcee_fusion"}, weights=False, models=1),
    # a threshold of 0.01 makes about a third of each task vector's entries count as unchanged
    Case("ram", "ram", {"method": "ram", "nonzero_threshold": 0.01}, {"epsilon": 0.01},
         weights=False),
    Case("ramplus_tl", "ramplus_tl", {"method": "ramplus_tl", "nonzero_threshold": 0.01,
                                      "r": 0.5, "alpha": 0.5},
         {"epsilon": 0.01, "r": 0.5, "alpha": 0.5}, weights=False),
]
RANDOM_CASES = [
    Case("dare_linear", "dare_linear", {"method": "dare_linear", "density": 0.6},
         mk_model_params={"density": 0.6}, conventions={"rescale": "l1", "normalize": False}),
    Case("dare_ties", "dare_ties", {"method": "dare_ties", "density": 0.6},
         mk_model_params={"density": 0.6},
         conventions={"rescale": "l1", "normalize": False, "zero_vote": "positive"}),
    Case("della", "della", {"method": "della", "density": 0.6, "epsilon": 0.2},
         mk_model_params={"density": 0.6, "epsilon": 0.2},
         conventions={"rescale": "l1", "zero_vote": "positive"}),
    Case("della_linear", "della_linear", {"method": "della_linear", "density": 0.6,
                                          "epsilon": 0.2},
         mk_model_params={"density": 0.6, "epsilon": 0.2},
         conventions={"rescale": "l1", "normalize": False}),
]


def _g(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def markdown(meta: dict, exact: list[dict], randoms: list[dict]) -> str:
    from stamp import stamp_line

    lines = [
        "# Parity with mergekit",
        "",
        stamp_line(meta["provenance"]),
        "",
        f"`python benchmarks/mergekit_parity.py`: mergekit {meta['mergekit']}, "
        f"a random Llama (hidden {meta['hidden']}, {meta['layers']} layers, "
        f"{meta['params'] / 1e6:.1f}M parameters, float32; a Qwen3 of the same shape where the "
        "row says so) and three copies with N(0, 0.01²) "
        "noise; weights 1, 0.6, 1.4 where the method takes weights. max |Δ| is over every "
        "tensor of the output. *With options*: the moemerge recipe sets the options in the "
        "third column, which switch its conventions to mergekit's; *defaults*: the same recipe "
        "without them.",
        "",
        "| method | mergekit method | moemerge options for mergekit's conventions | max \\|Δ\\| "
        "with options | max \\|Δ\\| with moemerge defaults |",
        "|---|---|---|---:|---:|",
    ]
    for r in exact:
        lines.append(f"| {r['method']} | `{r['mergekit']}` | {r['options']} | "
                     f"{_g(r['max_abs_delta'])} | {_g(r.get('max_abs_delta_defaults'))} |")
    lines += [
        "",
        "## Random methods",
        "",
        "DARE and DELLA masks come from different generators (moemerge: one per output tensor, "
        "seeded from the recipe seed and the tensor name; mergekit: torch's global RNG), so "
        "they are compared on statistics of a one-model merge (Δ = output − base against the "
        "task vector τ, over all tensors): the fraction of entries kept, the rescale of the "
        "survivors (‖Δ‖₁ / ‖τ ⊙ kept‖₁), the L1 norm kept (‖Δ‖₁ / ‖τ‖₁), and the kept "
        "fraction among the larger and the smaller half of |τ| (DELLA keeps large entries more "
        "often). Last columns, three models: the cosine between the two tools' merged task "
        "vectors and, for scale, between moemerge's with seeds 0 and 1 (two draws of one "
        "method).",
        "",
        "| method | tool | options | kept | rescale | L1 kept | kept, top half | "
        "kept, bottom half | cosine to mergekit, 3 models | cosine seed 0 / seed 1, 3 models |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in randoms:
        lines.append(
            f"| {r['method']} | {r['tool']} | {r['options']} | {r['kept']:.4f} | "
            f"{r['rescale']:.4f} | {r['l1_kept']:.4f} | {r['kept_top_half']:.4f} | "
            f"{r['kept_bottom_half']:.4f} | {_g(r.get('cosine_3_models'))} | "
            f"{_g(r.get('cosine_seeds'))} |")
    return "\n".join(lines) + "\n" + NOTES


NOTES = """
The conventions that differ, and the options that switch them, are listed in
[docs/mergekit.md](../../docs/mergekit.md#conventions). What remains is float rounding (≤ 2.4e-7);
entries *tied* at a cut-off are switched too: by default moemerge finds a cut-off with
`kthvalue` (linear time, in row blocks) and keeps every entry equal to it, where mergekit sorts
the whole tensor and keeps exactly k; `trim_rounding: sort` (what import-mergekit writes, and
these rows) makes the same sort. Before it, the breadcrumbs rows differed in one entry of
`lm_head.weight`, whose task vector had two equal magnitudes at the lower cut-off (1.89e-3);
random N(0, 0.01²) float32 noise has such ties rarely, bf16-valued weights have many.
Random methods: the statistics agree to the sampling noise, and the cosine between the two
tools' merges equals that between two moemerge seeds: the tools differ only by the draw.
Gradients: the `t: [0, 1]` row covers the tensors outside the layers, which mergekit 0.1 takes
at the gradient's first value, the final norm and head too (mergekit 0.0.6 took those two at
the last value; with it this row would differ by the distance between the models, ~0.06). The
Qwen3 row: mergekit's `norm` filter, a name substring, also selects `self_attn.q_norm` and
`k_norm`; the recipe's `tensors: [norm]` override selects the same tensors. mergekit's
`nearswap` `t` and `ram` `epsilon` are moemerge's `swap_distance` and `nonzero_threshold`.
`arcee_fusion`: every tensor here has fewer than 10⁶ entries, so mergekit's quartiles are exact
too (above that it samples them).
"""
