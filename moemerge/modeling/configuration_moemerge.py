"""Configuration of moemerge's sequence-routed MoE kinds (shipped next to the weights).

One config for both kinds:
- `seq_routed`: N homogeneous experts, each keeping its whole decoder stack (attention and FFN
  from the same expert); embeddings and head merged (shared) or kept per expert.
- `bridged`: N heterogeneous experts (other widths, depths or families) behind a shared
  embedding and head of width d_m = the widest expert's; per expert a proj-in (d_m → d_i) and a
  proj-out (d_i → d_m).
One routing decision per sequence (`router`: learned, perplexity or task_vector), top
`num_experts_per_seq` experts, their outputs mixed by the routing weights (`mix`).

This file is copied verbatim into every output directory: it imports only transformers.
"""

from __future__ import annotations

from transformers import PretrainedConfig

ASSEMBLIES = ("seq_routed", "bridged")
ROUTERS = ("learned", "perplexity", "task_vector")
ROUTER_INPUTS = ("mean_embedding", "rms_mean_embedding")
PERPLEXITY_SCORES = ("inverse", "log_inverse")
MIXES = ("logits", "hidden")


class MoemergeConfig(PretrainedConfig):
    r"""
    Args:
        assembly: "seq_routed" or "bridged".
        experts: each expert's dense config (a config.json dict with its `model_type`).
        expert_names: display names, one per expert.
        base: the base model's dense config when the checkpoint keeps the base (`base.*`
            tensors) for task-vector routing, else None.
        vocab_size, hidden_size: the shared vocabulary and d_m (the widest expert's width).
        shared_embeddings / shared_lm_head: one merged embedding / head (`embed_tokens`,
            `lm_head`), or one per expert (`experts.{i}.model.embed_tokens`,
            `experts.{i}.lm_head`). Bridged experts always share both.
        projector_hidden_size: width of the MLP branch of each projector (bridged only);
            0 makes projectors plain linear maps.
        router: "learned" (a linear router on the mean token embedding), "perplexity"
            (softmax over the top-k scores of each expert's perplexity on the sequence; see
            perplexity_score) or "task_vector"
            (cosine between the base model's descent direction on the sequence and each
            expert's task vector; needs `base`).
        router_input: what the learned router reads: "rms_mean_embedding" (the mean token
            embedding divided by its root mean square, so its logits do not shrink with the
            embedding's scale; written by moemerge since the calibrate init) or
            "mean_embedding" (unnormalised; the default, so older checkpoints, whose configs
            lack the key, compute as before).
        perplexity_score: a perplexity router's score: "log_inverse" (log 1/PPL = −mean NLL:
            the weights are 1/PPL^(1/temperature), normalised over the top k; written by
            moemerge since this key exists) or "inverse" (1/PPL itself, whose small, close
            values leave the weights near uniform; the default, so older checkpoints, whose
            configs lack the key, compute as before).
        num_experts_per_seq: k, the experts each sequence goes to.
        mix: "logits" mixes the experts' next-token distributions; "hidden" mixes their final
            hidden states (d_m) before the shared head.
        routing_temperature: softmax temperature over the top-k routing scores.
        task_vector_params: substrings naming the expert/base parameters whose task vectors
            the task_vector router compares (default: every decoder-layer parameter).
    """

    model_type = "moemerge"

    def __init__(
        self,
        assembly: str = "seq_routed",
        experts: list[dict] | None = None,
        expert_names: list[str] | None = None,
        base: dict | None = None,
        vocab_size: int = 0,
        hidden_size: int = 0,
        shared_embeddings: bool = True,
        shared_lm_head: bool = True,
        projector_hidden_size: int = 0,
        router: str = "learned",
        router_input: str = "mean_embedding",
        perplexity_score: str = "inverse",
        num_experts_per_seq: int = 1,
        mix: str = "logits",
        routing_temperature: float = 1.0,
        task_vector_params: list[str] | None = None,
        use_cache: bool = True,
        **kwargs,
    ):
        self.assembly = assembly
        self.experts = list(experts or [])
        self.expert_names = list(expert_names or [f"expert_{i}" for i in range(len(self.experts))])
        self.base = base
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.shared_embeddings = shared_embeddings or assembly == "bridged"
        self.shared_lm_head = shared_lm_head or assembly == "bridged"
        self.projector_hidden_size = projector_hidden_size
        self.router = router
        self.router_input = router_input
        self.perplexity_score = perplexity_score
        self.num_experts_per_seq = num_experts_per_seq
        self.mix = mix
        self.routing_temperature = routing_temperature
        self.task_vector_params = list(task_vector_params or ["layers."])
        self.use_cache = use_cache
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        if self.experts:  # an empty config is what transformers builds to read defaults
            self.check()

    @property
    def num_experts(self) -> int:
        return len(self.experts)

    def check(self) -> None:
        """Raise ValueError naming the field when the settings cannot work together."""
        problems = []
        if self.assembly not in ASSEMBLIES:
            problems.append(f"assembly: {self.assembly!r} is not one of {ASSEMBLIES}")
        if self.router not in ROUTERS:
            problems.append(f"router: {self.router!r} is not one of {ROUTERS}")
        if self.router_input not in ROUTER_INPUTS:
            problems.append(f"router_input: {self.router_input!r} is not one of {ROUTER_INPUTS}")
        if self.perplexity_score not in PERPLEXITY_SCORES:
            problems.append(f"perplexity_score: {self.perplexity_score!r} is not one of "
                            f"{PERPLEXITY_SCORES}")
        if self.mix not in MIXES:
            problems.append(f"mix: {self.mix!r} is not one of {MIXES}")
        if not 1 <= self.num_experts_per_seq <= self.num_experts:
            problems.append(f"num_experts_per_seq: {self.num_experts_per_seq} is not between 1 "
                            f"and the number of experts ({self.num_experts})")
        if self.mix == "hidden" and not self.shared_lm_head:
            problems.append("mix: 'hidden' mixes hidden states before one shared head, but "
                            "shared_lm_head is false")
        if self.router == "task_vector" and self.base is None:
            problems.append("router: 'task_vector' needs the base model (config.base), which "
                            "this checkpoint does not keep")
        if self.routing_temperature <= 0:
            problems.append(f"routing_temperature: {self.routing_temperature} must be > 0")
        if problems:
            raise ValueError("; ".join(problems))


CURVATURES = ("none", "kronecker")
MASKS = ("none", "ties", "dare")


class MoemergeMergedConfig(PretrainedConfig):
    r"""Merged-experts MoE (SMEAR / Lory / CAMEx): a dense model (`base`, its config.json dict)
    whose every FFN is, per segment of `segment_length` tokens, the merge
    W = E_m + α Σ_i s_i · mask_i ⊙ M_i(τ_i) of a reference FFN E_m and `num_experts` expert FFNs.

    Args:
        base: the dense config of the backbone (attention, norms, embeddings, head).
        num_experts, expert_names: the experts.
        segment_length: T; segment k is routed by the mean hidden state of segment k − 1.
        alpha: α.
        curvature: "none" (M = I: plain soft merging) or "kronecker" (rank `curvature_rank`).
        mask: "none", "ties" (entries agreeing with the elected sign of the M_i τ_i) or "dare"
            (in training, drop whole experts per segment with probability `dare_p`).
        dynamic: E_m of layer l + 1 is E_m^l + α · mean_i M_i τ_i^l (the paper's α/(N − 1) Σ,
            its N counting the base expert); only layer 0 stores an E_m.
    """

    model_type = "moemerge_merged"

    def __init__(self, base: dict | None = None, num_experts: int = 0,
                 expert_names: list[str] | None = None, segment_length: int = 64,
                 alpha: float = 1.0, curvature: str = "none", curvature_rank: int = 1,
                 mask: str = "none", dare_p: float = 0.1, dynamic: bool = False,
                 use_cache: bool = True, **kwargs):
        self.base = base
        self.num_experts = num_experts
        self.expert_names = list(expert_names or [f"expert_{i}" for i in range(num_experts)])
        self.segment_length = segment_length
        self.alpha = alpha
        self.curvature = curvature
        self.curvature_rank = curvature_rank
        self.mask = mask
        self.dare_p = dare_p
        self.dynamic = dynamic
        self.use_cache = use_cache
        if base:
            for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
                kwargs.setdefault(key, base.get(key))
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        if base:
            self.check()

    def check(self) -> None:
        problems = []
        if self.curvature not in CURVATURES:
            problems.append(f"curvature: {self.curvature!r} is not one of {CURVATURES}")
        if self.mask not in MASKS:
            problems.append(f"mask: {self.mask!r} is not one of {MASKS}")
        if self.segment_length < 1 or self.curvature_rank < 1:
            problems.append("segment_length and curvature_rank must be at least 1")
        if not 0 <= self.dare_p < 1:
            problems.append(f"dare_p: {self.dare_p} is not in [0, 1)")
        if problems:
            raise ValueError("; ".join(problems))


class MoemergeLoraConfig(PretrainedConfig):
    r"""An MoE of LoRA experts (X-LoRA / MoLE): a dense model (`base`, its config.json dict)
    whose every targeted linear module adds its experts' low-rank deltas, mixed per token by
    the router of the block holding it.

    Args:
        base: the dense config of the backbone.
        num_experts, expert_names: the experts (one LoRA adapter each).
        experts_per_token: k, the experts each token mixes (the top k of the softmax,
            renormalised); num_experts: a dense mixture of every expert.
        lora_ranks: {module name (model.layers.0.mlp.gate_proj): R}, the targeted modules and
            the rank their factors are stored at (the largest of the experts').
    """

    model_type = "moemerge_lora"

    def __init__(self, base: dict | None = None, num_experts: int = 0,
                 expert_names: list[str] | None = None, experts_per_token: int = 1,
                 lora_ranks: dict[str, int] | None = None, use_cache: bool = True, **kwargs):
        self.base = base
        self.num_experts = num_experts
        self.expert_names = list(expert_names or [f"expert_{i}" for i in range(num_experts)])
        self.experts_per_token = experts_per_token
        self.lora_ranks = dict(lora_ranks or {})
        self.use_cache = use_cache
        if base:
            for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
                kwargs.setdefault(key, base.get(key))
            kwargs.setdefault("tie_word_embeddings", base.get("tie_word_embeddings", False))
        super().__init__(**kwargs)
        if base:
            self.check()

    def check(self) -> None:
        problems = []
        if not 1 <= self.experts_per_token <= self.num_experts:
            problems.append(f"experts_per_token: {self.experts_per_token} is not between 1 and "
                            f"num_experts ({self.num_experts})")
        bad = {name: rank for name, rank in self.lora_ranks.items()
               if not name.startswith("model.") or not isinstance(rank, int) or rank < 1}
        if bad:
            problems.append(f"lora_ranks: {bad} are not model.* module names with ranks >= 1")
        if problems:
            raise ValueError("; ".join(problems))
