"""Plans of the sequence-routed kinds: seq_routed (homogeneous experts, separate attention) and
bridged (heterogeneous experts behind projectors). Same jobs, same executor as token_routed.

Output tensors (see moemerge/modeling/modeling_moemerge.py):
  embed_tokens.weight [V, d_m], lm_head.weight [V, d_m]     shared (merged, or padded average)
  router.weight [N, d_m]                                     sequence router
  experts.{i}.model.*                                        expert i's decoder stack, as is
  experts.{i}.model.embed_tokens.weight, experts.{i}.lm_head.weight    per_expert copies
  experts.{i}.proj_{in,out}.{linear,up,down}.weight          bridged projectors
  base.*                                                     the base, for task_vector routing
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

from moemerge.architectures.config import sequence_config
from moemerge.plan.common import merge_job, output_dtype, write_order
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.params import ResolvedMerge
from moemerge.plan.sources import SourceModel
from moemerge.plan.vocab import map_vocabularies, mapped_source
from moemerge.recipe.sequence import BridgedRecipe, SeqRoutedRecipe

SHARED = {"embed": "embed_tokens.weight", "lm_head": "lm_head.weight"}
SIDE_ROLE = {"in": "embed", "out": "lm_head"}  # what each projector's lstsq init fits
PER_EXPERT = {"embed": "experts.{i}.model.embed_tokens.weight",
              "lm_head": "experts.{i}.lm_head.weight"}


def role_tensor(model: SourceModel, role: str) -> str:
    """The model's embedding or head tensor; a tied model's head is its embedding."""
    found = [n for n, r in model.roles.items() if r.role == role]
    return found[0] if found else role_tensor(model, "embed")


def body_jobs(model: int, source: SourceModel, prefix: str, dtype) -> list[Job]:
    """Copies of a dense model's decoder stack and final norm under `prefix`."""
    return [Job(f"{prefix}{name}", source.reader.meta(name).shape, dtype, "copy",
                source.roles[name].role, source.roles[name].layer, (Source(model, name),))
            for name in write_order(source.roles)
            if source.roles[name].role not in ("embed", "lm_head")]


def _router_job(recipe, experts: list[int], models: list[SourceModel], width: int, dtype,
                source: Callable[[int, str], Source] = Source) -> Job:
    """router.weight [N, d_m]; the prompts init reads the experts' embeddings."""
    prompts = recipe.router.kind == "learned" and recipe.router.init == "prompts"
    sources = tuple(source(m, role_tensor(models[m], "embed")) for m in experts) if prompts else ()
    init = "prompts" if prompts else "calibrate" if recipe.router.init == "calibrate" else "random"
    return Job("router.weight", (len(experts), width), dtype, "router", "router", None, sources,
               router_init=init)


def _settings(recipe) -> dict:
    return {"router": recipe.router.kind, "router_input": "rms_mean_embedding",
            "perplexity_score": "log_inverse",
            "num_experts_per_seq": recipe.experts_per_sequence,
            "mix": recipe.mix, "routing_temperature": recipe.router.temperature,
            "task_vector_params": list(recipe.router.task_vector_params)}


def plan_seq_routed(recipe: SeqRoutedRecipe, models: list[SourceModel]) -> Plan:
    """models = [base?] + experts; every expert keeps its stack, embeddings and head merged
    across experts (or kept per expert), a router, and the base for task_vector routing."""
    base = 0 if recipe.base_model is not None else None
    experts = list(range(int(base is not None), len(models)))
    ref = models[experts[0]]
    dtype = output_dtype(recipe.output.dtype, models[0])
    width = ref.config["hidden_size"]
    jobs = []
    for role in ("embed", "lm_head"):
        name = role_tensor(ref, role)
        shape = ref.reader.meta(name).shape
        if role in recipe.per_expert:
            jobs += [Job(PER_EXPERT[role].format(i=i), shape, dtype, "copy", role, None,
                         (Source(m, role_tensor(models[m], role)),))
                     for i, m in enumerate(experts)]
        else:
            jobs.append(merge_job(name, role, None, shape, dtype, recipe.merge, experts,
                                  recipe.experts, base, output=SHARED[role]))
    jobs.append(_router_job(recipe, experts, models, width, dtype))
    for i, m in enumerate(experts):
        jobs += body_jobs(m, models[m], f"experts.{i}.", dtype)
    keep_base = recipe.router.kind == "task_vector"
    if keep_base:
        jobs += _base_jobs(models[0], dtype)
    config = sequence_config(
        "seq_routed", [models[m].config for m in experts], [models[m].label for m in experts],
        dtype=dtype, width=width, token_source=ref.config,
        base=models[0].config if keep_base else None,
        shared_embeddings="embed" not in recipe.per_expert,
        shared_lm_head="lm_head" not in recipe.per_expert, **_settings(recipe))
    return Plan([m.label for m in models], jobs, config)


def _base_jobs(base: SourceModel, dtype) -> list[Job]:
    """The whole base model under base.*, its head written out even when tied."""
    embed, head = role_tensor(base, "embed"), role_tensor(base, "lm_head")
    jobs = [Job(f"base.{embed}", base.reader.meta(embed).shape, dtype, "copy", "embed", None,
                (Source(0, embed),))]
    jobs += body_jobs(0, base, "base.", dtype)
    jobs.append(Job("base.lm_head.weight", base.reader.meta(head).shape, dtype, "copy",
                    "lm_head", None, (Source(0, head),)))
    return jobs


def plan_bridged(recipe: BridgedRecipe, models: list[SourceModel]) -> Plan:
    """models = experts (any widths, depths, families; the embedding and head of those with
    another vocabulary than the tokenizer's expert read through plan/vocab.py's mapping).
    Shared embedding and head: the experts' zero-padded to d_m and averaged; per expert its
    stack and projectors."""
    token = recipe.tokenizer_index
    maps, notes = map_vocabularies(models, token)
    source = partial(mapped_source, models, maps)
    widths = [m.config["hidden_size"] for m in models]
    width, vocab = max(widths), models[token].config["vocab_size"]
    dtype = output_dtype(recipe.output.dtype, models[token])
    weights = tuple(e.weight for e in recipe.experts)
    shared = {role: Job(SHARED[role], (vocab, width), dtype, "merge", role, None,
                        tuple(source(i, role_tensor(m, role)) for i, m in enumerate(models)),
                        weights=weights, merge=ResolvedMerge("average"))
              for role in ("embed", "lm_head")}
    jobs = list(shared.values())
    jobs.append(_router_job(recipe, list(range(len(models))), models, width, dtype, source))
    init_range = models[token].config.get("initializer_range", 0.02)
    for i, model in enumerate(models):
        jobs += body_jobs(i, model, f"experts.{i}.", dtype)
        for side, d_in, d_out in (("in", width, widths[i]), ("out", widths[i], width)):
            jobs += _projector_jobs(f"experts.{i}.proj_{side}", d_in, d_out, recipe, init_range,
                                    dtype, fit=shared[SIDE_ROLE[side]],
                                    own=source(i, role_tensor(model, SIDE_ROLE[side])))
    configs = [dict(m.config, vocab_size=vocab) if i in maps else m.config
               for i, m in enumerate(models)]
    config = sequence_config(
        "bridged", configs, [m.label for m in models], dtype=dtype,
        width=width, token_source=models[token].config, base=None, shared_embeddings=True,
        shared_lm_head=True, projector_hidden_size=recipe.projectors.hidden_size,
        **_settings(recipe))
    return Plan([m.label for m in models], jobs, config, notes)


def _projector_jobs(prefix: str, d_in: int, d_out: int, recipe: BridgedRecipe,
                    init_range: float, dtype, *, fit: Job, own: Source) -> list[Job]:
    """linear [d_out, d_in] (+ up [r, d_in], down [d_out, r]). identity: linear selects or pads
    coordinates; lstsq: linear fits the shared embedding / head (`fit`, its sources) to the
    expert's own (`own`); both with down = 0, so the MLP branch starts silent. random: every
    weight random."""
    spec, r = recipe.projectors, recipe.projectors.hidden_size
    init = spec.init if spec.init != "auto" else (
        "identity" if len(recipe.experts) == 1 else "lstsq")

    def random(name: str, shape: tuple[int, int], std: float) -> Job:
        return Job(f"{prefix}.{name}.weight", shape, dtype, "random", "projector",
                   std=spec.std or std)

    name = f"{prefix}.linear.weight"
    linear = {
        "identity": lambda: Job(name, (d_out, d_in), dtype, "identity", "projector"),
        # role: which side of the fit the solution is (see execute.compute)
        "lstsq": lambda: Job(name, (d_out, d_in), dtype, "lstsq", prefix.rsplit(".", 1)[-1],
                             sources=fit.sources, base=own, weights=fit.weights),
        "random": lambda: random("linear", (d_out, d_in), 1 / math.sqrt(d_in)),
    }[init]()
    if not r:
        return [linear]
    down = (random("down", (d_out, r), init_range) if init == "random"
            else Job(f"{prefix}.down.weight", (d_out, r), dtype, "zeros", "projector"))
    return [linear, random("up", (r, d_in), init_range), down]
