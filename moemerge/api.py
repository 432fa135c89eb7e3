"""The Python API behind the CLI: build a checkpoint from a recipe."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import yaml

from moemerge.assemble.card import model_card
from moemerge.assemble.remote_code import copy_modeling_code
from moemerge.assemble.verify import FULL_LOAD_LIMIT, check_loads, check_structure
from moemerge.errors import CheckpointError, RecipeError
from moemerge.eval.perplexity import load_tokenizer
from moemerge.execute import check_device, run_jobs
from moemerge.io.atomic import (
    RECIPE_COPY,
    SIDE_FILES,
    atomic_output_dir,
    copy_side_files,
    sweep_output,
)
from moemerge.io.outputs import check_output
from moemerge.io.paths import check_output_apart
from moemerge.io.reader import CheckpointReader, TensorMeta, count_non_finite_stored
from moemerge.io.writer import (
    ShardedWriter,
    finite,
    overwrite_tensors,
    parse_size,
    refuse_non_finite,
)
from moemerge.loading import load_causal_lm
from moemerge.merge.primitives import count_non_finite
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.memory import Estimate, estimate
from moemerge.plan.params import override_layer_warnings
from moemerge.plan.recipe_plan import labelled_refs as _labelled_refs
from moemerge.plan.recipe_plan import make_plan
from moemerge.plan.sources import SourceModel, open_sources
from moemerge.plan.upcycle import upcycle_sources
from moemerge.plan.vocab import map_vocabularies
from moemerge.progress import Stages
from moemerge.recipe.load import AnyRecipe, load_recipe, parse_recipe
from moemerge.recipe.merged import MergedExpertsRecipe
from moemerge.recipe.models import MergeRecipe, MoERecipe
from moemerge.recipe.sequence import BridgedRecipe
from moemerge.recipe.shrink import ShrinkRecipe
from moemerge.recipe.upcycle import UpcycleRecipe
from moemerge.report import human_bytes
from moemerge.routing.statistics import keep_statistics
from moemerge.shrink import Shrunk, shrink
from moemerge.train.calibration import (
    calibrated_routers,
    calibrates,
    calibration_set,
    calibration_texts,
    expert_models,
)
from moemerge.tune import (
    TUNING_FILE,
    Candidate,
    TuneOptions,
    TuneResult,
    check_length,
    check_options,
    read_held_out,
    search,
    tunable_jobs,
    tuned_recipe_text,
    tuning_json,
)

Verify = Literal["auto", "full", "structure"]


@dataclass
class BuildResult:
    plan: Plan
    output: Path | None  # None for a dry run
    verified: str  # "full", "structure" or "none"
    tuning: TuneResult | None = None  # with tune=...: every candidate and the chosen values
    estimate: Estimate | None = None  # peak memory and output size, known before any data
    shrunk: Shrunk | None = None  # kind: shrink: what was kept (its plan has no jobs)


def _tokenizer_source(recipe: AnyRecipe, models: list[SourceModel]) -> SourceModel:
    """The model whose tokenizer (and generation config) the output keeps."""
    if isinstance(recipe, BridgedRecipe):
        return models[recipe.tokenizer_index]
    return models[0]


def _router_maker(recipe: AnyRecipe, models: list[SourceModel]):
    from moemerge.routing.routers import (
        RouterFactory,
        SequenceRouterFactory,
        UpcycleRouterFactory,
    )

    if isinstance(recipe, UpcycleRecipe):
        return UpcycleRouterFactory(recipe, models[0].config).make
    if isinstance(recipe, MoERecipe):
        base = models[0]
        return RouterFactory(recipe, base.path, base.config, lambda: _embed_and_norms(base),
                             ffn_module=base.family.ffn_module).make
    source = _tokenizer_source(recipe, models)
    return SequenceRouterFactory(recipe, source.path, source.config).make


def build(
    recipe_path: Path,
    out: Path | None,
    *,
    force: bool = False,
    dry_run: bool = False,
    allow_pickle: bool = False,
    verify: Verify = "auto",
    progress: bool = True,
    lookahead: int = 3,
    workers: int = 1,
    device: str = "cpu",
    tune: TuneOptions | None = None,
    on_candidate: Callable[[Candidate], None] | None = None,
    strict: bool = False,
    allow_non_finite: bool = False,
    warn: Callable[[str], None] | None = None,
) -> BuildResult:
    """Build `out` from the recipe. With `tune`, first choose λ and density per role on held-out
    text (docs/tuning.md) and build with them; the recipe copy in `out` records them.

    NaN / Inf in an input tensor is a warning (`warn`, default `warnings.warn`) naming the
    tensor and the model, an error with `strict`; a non-finite output tensor is refused unless
    `allow_non_finite`. `workers` threads merge at once (the bytes do not depend on it);
    `device` runs the merge arithmetic (e.g. "cuda") while reading and writing stay on the
    host. `progress` shows each stage as it runs, on stderr."""
    if workers < 1:
        raise RecipeError(f"--workers: must be at least 1, got {workers}")
    if lookahead < 1:
        raise RecipeError(f"--lookahead: must be at least 1, got {lookahead}")
    device = check_device(device)
    recipe_path = Path(recipe_path)
    out = Path(out) if out is not None else None
    warn = warn or _warn
    stage = Stages(progress)
    recipe = load_recipe(recipe_path)
    if out is not None and not dry_run:  # before any model is read
        sweep_output(out)  # what a killed run for this output left
        # refuse before reading anything; atomic_output_dir checks again at the end
        check_output(out, _local_inputs(recipe, recipe_path, tune), force=force,
                     directory=True,
                     contained=[("the recipe's directory", recipe_path.absolute().parent)])
    if isinstance(recipe, ShrinkRecipe):
        return _build_shrink(recipe, recipe_path, out, force=force, dry_run=dry_run,
                             tune=tune, verify=verify, progress=progress)
    try:
        max_shard = parse_size(recipe.output.max_shard_size)
    except ValueError as exc:
        raise RecipeError(f"{recipe_path}: output.max_shard_size: {exc}") from None
    if tune is not None:
        if not isinstance(recipe, MergeRecipe | MoERecipe):
            raise RecipeError(f"--tune-on: only kind: merge and token-routed kind: moe recipes "
                              f"have a merge to tune; {recipe_path} is kind: {recipe.kind}"
                              + (f" ({recipe.assembly})" if hasattr(recipe, "assembly") else ""))
        if dry_run or out is None:
            raise RecipeError("--tune-on builds the model to score it; it cannot be a dry run")
        check_options(tune)
        held_out = read_held_out(tune.text)
    calibration = texts = None
    if calibrates(recipe) and not dry_run and out is not None:  # its errors before any tensor
        texts = _in_recipe(recipe_path, calibration_texts, recipe.calibration,
                           recipe_path.parent)
    with ExitStack() as stack:
        with stage("planning") as found:  # reading every model's header
            models = open_sources(
                _labelled_refs(recipe), recipe_path.parent, allow_pickle=allow_pickle, stack=stack,
                compatible=not isinstance(recipe, BridgedRecipe),
            )
            vocab_notes: list[str] = []
            if isinstance(recipe, UpcycleRecipe):  # the experts' FFN slices, made when read
                models = upcycle_sources(recipe, models)
            if isinstance(recipe, BridgedRecipe):  # other vocabularies mapped onto the kept one
                models, vocab_notes = map_vocabularies(models, recipe.tokenizer_index)
            plan = make_plan(recipe, models)
            plan.notes[:0] = vocab_notes
            found(f"{len(models)} models, {len(plan.jobs)} output tensors, "
                  f"{human_bytes(plan.total_bytes)}")
        for message in [*_override_warnings(recipe, models, plan), *plan.notes]:
            warn(message)
        if dry_run or out is None:
            sizes = estimate(plan, lambda s: models[s.model].reader.meta(s.tensor).nbytes,
                             max(lookahead, workers),
                             sum(getattr(m.reader, "resident_bytes", 0) for m in models))
            return BuildResult(plan, None, "none", estimate=sizes)
        check_output_apart(out, [(f"input model {m.label}", m.path) for m in models])
        seen_non_finite: set[Source] = set()

        def check_input(source: Source, bad: int) -> None:
            if bad and source not in seen_non_finite:
                seen_non_finite.add(source)
                message = (f"tensor {source.tensor!r} of {models[source.model].where()} holds "
                           f"{bad} NaN/Inf values")
                if strict:
                    raise CheckpointError(f"{message} (--strict)")
                warn(message)

        def load(source: Source):
            tensor = models[source.model].reader.read(source.tensor)
            if source.rows is not None:
                tensor = tensor[slice(*source.rows)]
            if source not in seen_non_finite:
                check_input(source, count_non_finite(tensor))
            return tensor

        def stored(source: Source):  # None where a reader remakes its tensors (upcycle, vocab)
            reader = models[source.model].reader
            return reader.stored(source.tensor) if isinstance(reader, CheckpointReader) else None

        whence = ("from non-finite inputs or merge settings; pass --allow-non-finite to write "
                  "it anyway")

        def check_finite(name: str, tensor) -> None:
            if not allow_non_finite:
                finite(name, tensor, whence)

        def put(writer: ShardedWriter, job: Job, tensor: torch.Tensor | TensorMeta) -> None:
            if isinstance(tensor, torch.Tensor):
                check_finite(job.output, tensor)
                writer.write(job.output, tensor)
                return
            # copied unchanged by the kernel: its values checked in place, once, as both
            # the input it is and the output it becomes
            bad = count_non_finite_stored(tensor)
            check_input(job.sources[0], bad)
            if not allow_non_finite:
                refuse_non_finite(job.output, bad, whence)
            writer.copy(job.output, tensor)

        def write(dest: Path, recipe: AnyRecipe, plan: Plan, recipe_text: str,
                  what: str = "merging") -> None:
            planned = [(j.output, j.dtype, tuple(j.shape)) for j in plan.jobs]
            with ShardedWriter(dest, planned, max_shard_bytes=max_shard) as writer:
                jobs = run_jobs(plan, load, make_router, recipe.seed, lookahead=lookahead,
                                workers=workers, device=device, stored=stored)
                for job, tensor in stage.bar(what, jobs, plan.total_bytes, len(plan.jobs),
                                             lambda item: item[0].nbytes):
                    put(writer, job, tensor)
            (dest / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
            copy_side_files(_tokenizer_source(recipe, models).path, dest, SIDE_FILES)
            if "auto_map" in plan.config:
                copy_modeling_code(dest)
            (dest / RECIPE_COPY).write_text(recipe_text)
            (dest / "README.md").write_text(model_card(recipe, plan, recipe_text))
            check_structure(dest, plan)

        recipe_text = recipe_path.read_text()
        tokenizer = None
        if tune is not None:  # every check before the first tensor is read
            tunable_jobs(plan)
            tokenizer = load_tokenizer(_tokenizer_source(recipe, models).path)
            check_length(tokenizer, held_out, tune)
        if texts is not None:  # windows and targets (loss targets run each expert)
            with stage("preparing the calibration text"):
                calibration = _in_recipe(
                    recipe_path, calibration_set, recipe.calibration, texts,
                    load_tokenizer(_tokenizer_source(recipe, models).path),
                    expert_models(recipe, models))
        # once per build, after every check: tuning changes merge parameters, never routers
        make_router = (None if isinstance(recipe, MergeRecipe | MergedExpertsRecipe)
                       else _router_maker(recipe, models))
        tuning = None
        # tuning writes a draft first: an untuned copy
        size = plan.total_bytes * (2 if tune is not None else 1)
        with atomic_output_dir(out, force=force, size=size) as tmp:
            if tune is not None:
                untuned = tmp / "untuned"
                untuned.mkdir()
                write(untuned, recipe, plan, recipe_text, "merging an untuned draft")
                model, _ = load_causal_lm(untuned)
                tuning = search(model, tokenizer, held_out, plan, load, recipe.seed, tune,
                                report=on_candidate)
                del model
                shutil.rmtree(untuned)
                recipe_text = tuned_recipe_text(recipe_text, tuning, tune)
                recipe = parse_recipe(yaml.safe_load(recipe_text), str(recipe_path))
                plan = make_plan(recipe, models)
                (tmp / TUNING_FILE).write_text(tuning_json(tuning, tune))
            write(tmp, recipe, plan, recipe_text)
            if calibration is not None:  # fitted on the model just written (routers: placeholders)
                with stage("calibrating the routers") as found:
                    stats: dict = {}
                    routers = calibrated_routers(recipe, plan, tmp, calibration, stats)
                    for name, router in routers.items():
                        check_finite(name, router)
                    overwrite_tensors(tmp, routers)
                    if stats:  # what `moemerge extend` refits the routers from
                        keep_statistics(tmp, stats, calibration.ids.shape[0])
                    found(f"{len(routers)} routers")
            full = verify == "full" or (verify == "auto" and plan.total_bytes <= FULL_LOAD_LIMIT)
            if full:
                with stage("checking that the output loads in transformers"):
                    check_loads(tmp)
        return BuildResult(plan, out, "full" if full else "structure", tuning)


def _build_shrink(recipe: ShrinkRecipe, recipe_path: Path, out: Path | None, *, force: bool,
                  dry_run: bool, tune: TuneOptions | None, verify: Verify,
                  progress: bool) -> BuildResult:
    """`kind: shrink`: statistics, then the shrunk MoE (moemerge/shrink)."""
    if dry_run or out is None or tune is not None:
        raise RecipeError(f"{recipe_path}: kind: shrink reads its calibration text through the "
                          "model to choose what to keep; it has no dry run and no --tune-on")
    done = _in_recipe(recipe_path, shrink, recipe, out, recipe_dir=recipe_path.parent,
                      recipe_text=recipe_path.read_text(), force=force,
                      verify=verify != "structure", progress=progress)
    return BuildResult(Plan([recipe.model.model], [], {}), out,
                       "structure" if verify == "structure" else "full", shrunk=done)


def _in_recipe(recipe_path: Path, fn, *args, **kwargs):
    """fn(*args), its RecipeError prefixed with the recipe file it is about."""
    try:
        return fn(*args, **kwargs)
    except RecipeError as exc:
        raise RecipeError(f"{recipe_path}: {exc}") from None


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _local_inputs(recipe: AnyRecipe, recipe_path: Path,
                  tune: TuneOptions | None) -> list[tuple[str, Path]]:
    """(what, path) of every local input: the recipe, the --tune-on text and every model
    reference that names an existing local directory."""
    found = [("the recipe", recipe_path)]
    if tune is not None:
        found.append(("the --tune-on text", Path(tune.text)))
    for label, ref in _labelled_refs(recipe):
        for candidate in (recipe_path.parent / ref.model, Path(ref.model).expanduser()):
            if candidate.is_dir():
                found.append((f"input model {label}", candidate))
    return found


def _override_warnings(recipe: AnyRecipe, models: list[SourceModel], plan: Plan) -> list[str]:
    """Override `layers:` name the output's layers: a slices merge's stack, else the models'
    (bridged: the deepest)."""
    merge = getattr(recipe, "merge", None)
    layers = (plan.config["num_hidden_layers"] if getattr(recipe, "slices", None)
              else max(m.config["num_hidden_layers"] for m in models))
    return override_layer_warnings(merge, layers) if merge is not None else []


def _embed_and_norms(base: SourceModel):
    """The base's embedding [V, H] and, per layer, the weight of the norm its FFN reads through
    (the family table's `router_input_norm`; ones where there is none), for cheap_embed."""
    import torch

    embed = next(n for n, r in base.roles.items() if r.role == "embed")
    layers = base.config["num_hidden_layers"]
    norm = base.family.router_input_norm
    if norm is None:
        return base.reader.read(embed), [torch.ones(base.config["hidden_size"])] * layers
    return base.reader.read(embed), [base.reader.read(f"model.layers.{layer}.{norm}")
                                     for layer in range(layers)]
