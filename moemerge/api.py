"""The Python API behind the CLI: build a checkpoint from a recipe."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moemerge.assemble.card import model_card
from moemerge.assemble.remote_code import copy_modeling_code
from moemerge.assemble.verify import FULL_LOAD_LIMIT, check_loads, check_structure
from moemerge.errors import OutputError, RecipeError
from moemerge.execute import run_jobs
from moemerge.io.atomic import atomic_output_dir, copy_side_files
from moemerge.io.writer import ShardedWriter, parse_size
from moemerge.plan.build import plan_merge, plan_token_routed
from moemerge.plan.jobs import Plan, Source
from moemerge.plan.merged import plan_merged_experts
from moemerge.plan.sequence import plan_bridged, plan_seq_routed
from moemerge.plan.sources import SourceModel, check_shared_vocabulary, open_sources
from moemerge.recipe.load import AnyRecipe, load_recipe
from moemerge.recipe.merged import MergedExpertsRecipe
from moemerge.recipe.models import MergeRecipe, MoERecipe
from moemerge.recipe.sequence import BridgedRecipe, SeqRoutedRecipe

Verify = Literal["auto", "full", "structure"]
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "generation_config.json",
)
RECIPE_COPY = "moemerge_recipe.yaml"


@dataclass
class BuildResult:
    plan: Plan
    output: Path | None  # None for a dry run
    verified: str  # "full", "structure" or "none"


def _labelled_refs(recipe: AnyRecipe) -> list[tuple[str, object]]:
    refs = []
    if getattr(recipe, "base_model", None) is not None:
        refs.append(("base", recipe.base_model))
    if getattr(recipe, "reference", None) is not None:
        refs.append(("reference", recipe.reference))
    inputs = recipe.models if isinstance(recipe, MergeRecipe) else recipe.experts
    for ref in inputs:
        label = getattr(ref, "name", None) or Path(ref.model.rstrip("/")).name
        taken = {lab for lab, _ in refs}
        refs.append((label if label not in taken else f"{label}#{len(refs)}", ref))
    return refs


def make_plan(recipe: AnyRecipe, models: list[SourceModel]) -> Plan:
    if isinstance(recipe, MergeRecipe):
        return plan_merge(recipe, models)
    if isinstance(recipe, SeqRoutedRecipe):
        return plan_seq_routed(recipe, models)
    if isinstance(recipe, BridgedRecipe):
        return plan_bridged(recipe, models)
    if isinstance(recipe, MergedExpertsRecipe):
        return plan_merged_experts(recipe, models)
    return plan_token_routed(recipe, models)


def _tokenizer_source(recipe: AnyRecipe, models: list[SourceModel]) -> SourceModel:
    """The model whose tokenizer (and generation config) the output keeps."""
    if isinstance(recipe, BridgedRecipe) and recipe.tokenizer is not None:
        return models[[e.name for e in recipe.experts].index(recipe.tokenizer)]
    return models[0]


def _router_maker(recipe: AnyRecipe, models: list[SourceModel]):
    from moemerge.routing.routers import RouterFactory, SequenceRouterFactory

    if isinstance(recipe, MoERecipe):
        base = models[0]
        return RouterFactory(recipe, base.path, base.config, lambda: _embed_and_norms(base)).make
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
) -> BuildResult:
    recipe_path = Path(recipe_path)
    out = Path(out) if out is not None else None
    recipe = load_recipe(recipe_path)
    try:
        max_shard = parse_size(recipe.output.max_shard_size)
    except ValueError as exc:
        raise RecipeError(f"{recipe_path}: output.max_shard_size: {exc}") from None
    if out is not None and out.exists() and not force and not dry_run:
        # refuse before reading anything; atomic_output_dir checks again at the end
        raise OutputError(f"{out} already exists; pass --force to replace it")
    with ExitStack() as stack:
        models = open_sources(
            _labelled_refs(recipe), recipe_path.parent, allow_pickle=allow_pickle, stack=stack,
            check=check_shared_vocabulary if isinstance(recipe, BridgedRecipe) else None,
        )
        plan = make_plan(recipe, models)
        if dry_run or out is None:
            return BuildResult(plan, None, "none")

        def load(source: Source):
            return models[source.model].reader.read(source.tensor)

        make_router = (None if isinstance(recipe, MergeRecipe | MergedExpertsRecipe)
                       else _router_maker(recipe, models))
        remote_code = "auto_map" in plan.config

        with atomic_output_dir(out, force=force) as tmp:
            planned = [(j.output, j.dtype, tuple(j.shape)) for j in plan.jobs]
            with ShardedWriter(tmp, planned, max_shard_bytes=max_shard) as writer:
                jobs = run_jobs(plan, load, make_router, recipe.seed, lookahead=lookahead)
                for job, tensor in _with_progress(jobs, plan, progress):
                    writer.write(job.output, tensor)
            (tmp / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
            copy_side_files(_tokenizer_source(recipe, models).path, tmp, SIDE_FILES)
            if remote_code:
                copy_modeling_code(tmp)
            recipe_text = recipe_path.read_text()
            (tmp / RECIPE_COPY).write_text(recipe_text)
            (tmp / "README.md").write_text(model_card(recipe, plan, recipe_text))
            check_structure(tmp, plan)
            full = verify == "full" or (verify == "auto" and plan.total_bytes <= FULL_LOAD_LIMIT)
            if full:
                check_loads(tmp, trust_remote_code=remote_code)
        return BuildResult(plan, out, "full" if full else "structure")


def _embed_and_norms(base: SourceModel):
    """The base's embedding [V, H] and post-attention norm weights, for cheap_embed routers."""
    embed = next(n for n, r in base.roles.items() if r.role == "embed")
    norms = sorted(
        (r.layer, n) for n, r in base.roles.items() if n.endswith("post_attention_layernorm.weight")
    )
    return base.reader.read(embed), [base.reader.read(n) for _, n in norms]


def _with_progress(jobs, plan: Plan, enabled: bool):
    if not enabled:
        yield from jobs
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("[bold]building"), BarColumn(),
        TextColumn(f"{{task.fields[done]}}/{len(plan.jobs)} tensors"),
        DownloadColumn(binary_units=True), TransferSpeedColumn(), TimeRemainingColumn(),
    )
    with Progress(*columns) as bar:
        task = bar.add_task("build", total=plan.total_bytes, done=0)
        for done, (job, tensor) in enumerate(jobs, start=1):
            yield job, tensor
            bar.update(task, advance=job.nbytes, done=done)
