"""Architecture tables (kept as data in dense.yaml / moe.yaml) and tensor classification."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

import yaml

from moemerge.errors import MismatchError

Role = str  # "embed" | "attn" | "norm" | "ffn" | "lm_head"


@dataclass(frozen=True)
class TensorRole:
    """What a dense tensor is: its role, its layer (None for global tensors), FFN projection."""

    name: str
    role: Role
    layer: int | None = None
    proj: str | None = None  # "gate" | "up" | "down" for role "ffn"; fused: "gate_up", "qkv"


@dataclass(frozen=True)
class DenseFamily:
    name: str
    model_types: tuple[str, ...]
    moe_target: str | None  # None: no transformers MoE class computes this family
    tensors: dict[str, str]
    layer_tensors: dict[str, str]
    optional: frozenset[str] = field(default_factory=frozenset)
    shared_target: str | None = None  # the layout when the recipe asks for a shared expert
    layouts: tuple[str, ...] = ()  # other layouts a recipe's `layout:` may pick
    router_input_norm: str | None = None  # the norm the FFN reads through (None: no norm)
    assemblies: frozenset[str] | None = None  # the MoE assemblies it may feed (None: all)
    must_agree: tuple[str, ...] = ()  # config keys every merged model must share
    layout: str | None = None  # an MoE checkpoint's layout (`moe_family`); None: dense
    attention_shapes: bool = True  # config.json's heads and head_dim give attention's shapes

    def target(self, shared_expert: bool) -> str:
        """The MoE layout a token-routed build writes, with or without a shared expert."""
        return self.shared_target if shared_expert and self.shared_target else self.moe_target

    @property
    def ffn_module(self) -> str:
        """The layer's FFN module ("mlp"): its input is what an MoE's router reads."""
        ffn = next(rest for rest, role in self.layer_tensors.items() if role.startswith("ffn."))
        return ffn.rsplit(".", 2)[0]

    def classify(self, name: str) -> TensorRole | None:
        if name in self.tensors:
            return TensorRole(name, self.tensors[name])
        match = _LAYER_NAME.fullmatch(name)
        if match and match["rest"] in self.layer_tensors:
            role, _, proj = self.layer_tensors[match["rest"]].partition(".")
            return TensorRole(name, role, int(match["layer"]), proj or None)
        return None

    @property
    def allowed_layouts(self) -> tuple[str, ...]:
        """Every MoE layout this family can be written as (`layout:` in a recipe)."""
        own = (self.moe_target, self.shared_target, *self.layouts)
        return tuple(dict.fromkeys(name for name in own if name is not None))

    def moe_layout(self, where: str, shared_expert: bool = False,
                   chosen: str | None = None) -> MoELayout:
        """The token-routed MoE layout of this family (`chosen` by the recipe, else its own,
        with or without a shared expert), or an error naming the kinds it can be."""
        if self.moe_target is None:
            raise MismatchError(
                f"{where}: no transformers MoE class computes a {self.name} model (its "
                "activation, norms or logit transforms), so it cannot become a token_routed or "
                "upcycled MoE; use assembly seq_routed, bridged or merged_experts, which run "
                f"{self.name}'s own transformers code")
        if chosen is not None and chosen not in self.allowed_layouts:
            raise MismatchError(
                f"layout: {chosen!r} cannot hold a {self.name} model ({where}); this family can "
                f"be written as {', '.join(self.allowed_layouts)}")
        return moe_layouts()[chosen or self.target(shared_expert)]


@dataclass(frozen=True)
class MoELayout:
    name: str
    architecture: str
    model_type: str
    expert: str
    projections: dict[str, str]
    router: str
    shared_expert: str | None = None  # the always-on expert's tensors, `{proj}` filled in
    shared_expert_gate: str | None = None  # its sigmoid gate [1, H]
    llama_cpp_renormalises_topk: bool = True
    renormalises_top1: bool = True  # False: a top-1 expert is scaled by its softmax weight
    renormalises_topk: bool = False  # True: whatever norm_topk_prob says (Mixtral, Granite)
    llama_cpp_converts: bool = True  # llama.cpp's convert_hf_to_gguf.py knows the architecture
    holds_biases: bool = True
    num_experts_key: str = "num_experts"
    expert_width_key: str = "intermediate_size"
    shared_width_key: str | None = None
    shared_count_key: str | None = None  # shared width in expert widths (None: no shared expert)
    zero_biases: tuple[str, ...] = ()  # `model.layers.{layer}.<module>.bias` written as zeros
    copied_config: tuple[str, ...] = ()  # source config keys this layout needs beyond COPIED
    config: dict = field(default_factory=dict)  # fixed config.json settings
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> projections
    fused_shared: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # transformers 5's names: fused name -> the projections it stacks per expert, or the one
    # classic name it renames (architectures/forms.py)
    fused_form: dict[str, tuple[str, ...] | str] = field(default_factory=dict)
    num_experts_aliases: tuple[str, ...] = ()  # the count's key in other transformers versions
    builds: bool = True  # False: read (merge, shrink, finetune ...) but written by no recipe
    router_bias: str | None = None  # DeepSeek-V3's per-expert routing bias [E]
    dense_layers_key: str | None = None  # config key: the first N layers have a dense FFN
    form: str = "classic"  # the form a plan writes it in (forms.written_layout)
    # a read-only family's tensors besides the sparse blocks' (`moe_family`)
    tensors: dict[str, str] = field(default_factory=dict)
    layer_tensors: dict[str, str] = field(default_factory=dict)
    latent_attention: bool = False  # DeepSeek's: attention shapes not heads x head_dim
    router_scoring: str = "softmax"  # DeepSeek-V3: sigmoid (plus its router bias)

    def expert_name(self, layer: int, expert: int, proj: str) -> str:
        return self.expert.format(layer=layer, expert=expert, proj=self.projections[proj])

    def shared_name(self, layer: int, proj: str) -> str:
        assert self.shared_expert is not None, f"{self.name} has no shared expert"
        return self.shared_expert.format(layer=layer, proj=self.projections[proj])

    def router_name(self, layer: int) -> str:
        return self.router.format(layer=layer)

    def experts_key(self, config: dict) -> str:
        """The key of `config` that holds its expert count: the layout's own, else the alias a
        transformers version saved it under (transformers 5 saves Qwen3-MoE's as
        num_local_experts)."""
        return next((key for key in (self.num_experts_key, *self.num_experts_aliases)
                     if key in config), self.num_experts_key)

    def expert_count(self, config: dict) -> int:
        return int(config[self.experts_key(config)])


_LAYER_NAME = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)")


def _load(file: str) -> dict:
    return yaml.safe_load(resources.files(__package__).joinpath(file).read_text())


@cache
def dense_families() -> dict[str, DenseFamily]:
    return {
        name: DenseFamily(
            name=name,
            model_types=tuple(spec["model_types"]),
            moe_target=spec["moe_target"],
            tensors=dict(spec["tensors"]),
            layer_tensors=dict(spec["layer_tensors"]),
            optional=frozenset(spec.get("optional", ())),
            shared_target=spec.get("shared_target"),
            layouts=tuple(spec.get("layouts", ())),
            router_input_norm=spec.get("router_input_norm"),
            assemblies=frozenset(spec["assemblies"]) if "assemblies" in spec else None,
            must_agree=tuple(spec.get("must_agree", ())),
        )
        for name, spec in _load("dense.yaml").items()
    }


@cache
def moe_layouts() -> dict[str, MoELayout]:
    def layout(name: str, spec: dict) -> MoELayout:
        tuples = {key: tuple(spec[key]) for key in ("copied_config", "zero_biases",
                                                    "num_experts_aliases")
                  if key in spec}
        fused = {key: {n: p if isinstance(p, str) else tuple(p) for n, p in spec[key].items()}
                 for key in ("fused", "fused_shared", "fused_form") if key in spec}
        return MoELayout(name=name, **{**spec, **tuples, **fused})

    return {name: layout(name, spec) for name, spec in _load("moe.yaml").items()}


def built_layouts() -> dict[str, MoELayout]:
    """The layouts a recipe's `layout:` may name (those moemerge only reads excluded)."""
    return {name: layout for name, layout in moe_layouts().items() if layout.builds}


def expert_count_keys() -> tuple[str, ...]:
    """The config.json keys that hold a token-routed MoE's expert count, one per layout key."""
    return tuple(dict.fromkeys(layout.num_experts_key for layout in moe_layouts().values()))


def family_for_config(config: dict, where: str) -> DenseFamily:
    """The family of a checkpoint, from its config.json `model_type`: a dense family, or an
    MoE's tensors as one (`moe_family`)."""
    model_type = config.get("model_type")
    for family in dense_families().values():
        if model_type in family.model_types:
            return family
    layout = next((lay for lay in moe_layouts().values() if lay.model_type == model_type), None)
    if layout is not None:
        return moe_family(layout, config)
    supported = sorted(t for f in dense_families().values() for t in f.model_types)
    moes = sorted(lay.model_type for lay in moe_layouts().values())
    raise MismatchError(
        f"{where}: model_type {model_type!r} is not supported. Dense model types: "
        f"{', '.join(supported)}; MoE model types (kind: merge of fine-tunes of one MoE, or "
        f"`expert:` of one): {', '.join(moes)}."
    )


MOE_INPUT = frozenset()  # an MoE feeds no assembly: it is merged (kind: merge), or one of its
# experts is taken (`expert:`)


def moe_family(layout: MoELayout, config: dict) -> DenseFamily:
    """An MoE checkpoint's tensors (its classic per-expert names, architectures/forms.py) as a
    family: the non-sparse tensors of the dense family it is built from (a read-only layout:
    its own list), each expert's projections (role ffn), the shared expert (ffn) and the
    routers, their gates and biases (role router)."""
    families = dense_families().values()  # its own source family first (Qwen2's, not Llama's)
    dense = next((f for f in families if layout.name in (f.moe_target, f.shared_target)),
                 next((f for f in families if layout.name in f.allowed_layouts), None))
    tensors = dict(dense.tensors) if dense else dict(layout.tensors)
    layer = {rest: role for rest, role in (dense.layer_tensors if dense else {}).items()
             if not role.startswith("ffn.")} | layout.layer_tensors

    def rest(template: str) -> str:
        return template.removeprefix("model.layers.{layer}.")

    for proj, disk in layout.projections.items():
        layer |= {rest(layout.expert).format(expert=e, proj=disk): f"ffn.{proj}"
                  for e in range(layout.expert_count(config))}
        if layout.shared_expert is not None and not layout.fused_shared:
            layer[rest(layout.shared_expert).format(proj=disk)] = f"ffn.{proj}"
    layer |= {rest(t): "ffn" for t in layout.fused_shared}  # [gate; up] rows, merged whole
    layer[rest(layout.router)] = "router"
    layer |= {rest(t): role for t, role in ((layout.shared_expert_gate, "shared_gate"),
                                            (layout.router_bias, "router_bias")) if t is not None}
    return DenseFamily(
        name=layout.name, model_types=(layout.model_type,), moe_target=None, tensors=tensors,
        layer_tensors=layer, optional=frozenset(["lm_head.weight"]), assemblies=MOE_INPUT,
        must_agree=(layout.experts_key(config), layout.expert_width_key, "num_experts_per_tok"),
        layout=layout.name, attention_shapes=not layout.latent_attention)
