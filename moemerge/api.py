"""The Python API behind the CLI: build a checkpoint from a recipe.

`build(recipe, out, options)` runs the stages of docs/design.md: check the output, open the
inputs' headers and plan (the recipe's kind, recipe/kinds.py, names the planner), then in the
output's temporary directory tune (`options.tune`), write every planned tensor through the one
execute loop, finish the directory (config, tokenizer, modeling code, card), calibrate the
routers, verify, install; then GGUF (`options.gguf`). Everything a kind does differently is
looked up in its entry.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import yaml

from moemerge.architectures.forms import FUSED
from moemerge.build_options import BuildOptions, build_options
from moemerge.errors import RecipeError
from moemerge.eval.perplexity import load_tokenizer
from moemerge.execute import CheckedTensors, check_device, run_jobs
from moemerge.finish.card import model_card
from moemerge.finish.gguf import (
    check_layout_converts,
    check_outtype,
    default_timeout,
    find_converter,
    write_gguf,
)
from moemerge.finish.remote_code import copy_modeling_code
from moemerge.finish.verify import FULL_LOAD_LIMIT, check_loads, check_structure
from moemerge.io.atomic import (
    RECIPE_COPY,
    SIDE_FILES,
    atomic_output_dir,
    copy_side_files,
    sweep_output,
)
from moemerge.io.outputs import check_output
from moemerge.io.paths import check_output_apart
from moemerge.io.writer import ShardedWriter, overwrite_tensors, parse_size
from moemerge.loading import check_seq_len, check_tokenizer_fits, vocab_rows
from moemerge.plan.jobs import Plan
from moemerge.plan.memory import Estimate, estimate, source_bytes, window_bytes
from moemerge.plan.params import override_layer_warnings
from moemerge.plan.recipe_plan import make_plan, open_and_plan
from moemerge.plan.sources import SourceModel
from moemerge.progress import Stages
from moemerge.recipe.kinds import KINDS, Kind, kind_of, labelled_refs
from moemerge.recipe.load import AnyRecipe, load_recipe, parse_recipe
from moemerge.rendering import human_bytes
from moemerge.routing.calibration import (
    calibrated_model,
    calibrated_routers,
    calibrates,
    calibration_texts,
    decided_later,
    expert_models,
    router_tensors,
)
from moemerge.routing.routers import router_maker
from moemerge.routing.statistics import keep_statistics
from moemerge.routing.top_k import choose_top_k, chosen_recipe_text, held_out_ids
from moemerge.tune import (
    TUNING_FILE,
    Candidate,
    Progress,
    TuneResult,
    check_length,
    check_options,
    read_held_out,
    tunable_jobs,
    tune_recipe,
    tuning_json,
)
from moemerge.words import plural

Warn = Callable[[str], None]


@dataclass(frozen=True)
class RecipeSource:
    """Where a recipe came from: relative model and text paths are resolved against `dir`
    (None: the working directory), `text` is copied into the output (tuning rewrites it), and
    `path`, for a file, names it in errors and keeps the output out of its directory."""

    text: str
    dir: Path | None = None
    path: Path | None = None

    @property
    def name(self) -> str:
        return str(self.path) if self.path is not None else "<recipe>"

    @classmethod
    def of(cls, recipe: AnyRecipe) -> RecipeSource:
        """A recipe made in Python: its text is its fields as YAML."""
        return cls(yaml.safe_dump(recipe.model_dump(mode="json", exclude_unset=True),
                                  sort_keys=False))


@dataclass
class BuildResult:
    plan: Plan
    output: Path | None  # None for a dry run
    verified: str  # "full", "structure" or "none"
    tuning: TuneResult | None = None  # with options.tune: every candidate and the chosen values
    estimate: Estimate | None = None  # peak memory and output size, known before any data
    whole: object | None = None  # a kind with no plan: what its runner returned (shrink.Shrunk,
    # stages.StagesBuilt); the plan has no jobs
    gguf: Path | None = None  # with options.gguf: the GGUF file written
    loaded: str | None = None  # with the full check: what loaded ("loaded in transformers as
    # MixtralForCausalLM, logits finite")


OnCandidate = Callable[[Candidate, Progress], None]  # build --tune-on's progress line


def build(
    recipe: AnyRecipe | Path | str,
    out: Path | None,
    options: BuildOptions | None = None,
    *,
    source: RecipeSource | None = None,
    progress: bool = True,
    warn: Warn | None = None,
    on_candidate: OnCandidate | None = None,
    **option_values,
) -> BuildResult:
    """Build `out` from a recipe: a parsed recipe object, or a recipe file's path (then
    `build_file`). `options` says how (BuildOptions; or its fields as keywords). `warn` gets
    each warning (default `warnings.warn`), `on_candidate` each tuning candidate; `progress`
    shows each stage as it runs, on stderr. With no `out`, or `dry_run`, the plan only."""
    if option_values:
        if options is not None:
            raise TypeError("build: give options or option keywords, not both")
        options = build_options(**option_values)
    options = options or BuildOptions()
    callbacks = {"progress": progress, "warn": warn or _warn, "on_candidate": on_candidate}
    if isinstance(recipe, str | Path):
        return build_file(Path(recipe), out, options, **callbacks)
    return _Build(recipe, source or RecipeSource.of(recipe), options, **callbacks).run(
        Path(out) if out is not None else None)


def build_file(path: Path, out: Path | None, options: BuildOptions | None = None,
               **callbacks) -> BuildResult:
    """`build` of the recipe file at `path` (the CLI's way in): its relative paths resolved
    against its directory, its text kept in the output."""
    path = Path(path)
    recipe = load_recipe(path)
    return build(recipe, out, options or BuildOptions(),
                 source=RecipeSource(path.read_text(), path.parent, path), **callbacks)



class _Build:
    """One build's state from checks to install; each method is a stage."""

    def __init__(self, recipe: AnyRecipe, source: RecipeSource, options: BuildOptions, *,
                 progress: bool, warn: Warn, on_candidate: OnCandidate | None):
        self.recipe, self.source, self.options = recipe, source, options
        self.kind: Kind = kind_of(recipe)
        self.warn, self.on_candidate = warn, on_candidate
        self.stage = Stages(progress)
        self.progress = progress

    def run(self, out: Path | None) -> BuildResult:
        options, recipe = self.options, self.recipe
        planning_only = options.dry_run or out is None
        self.device = check_device(options.device)
        self._check_kind(planning_only)
        if not planning_only:  # before any model is read
            sweep_output(out)  # what a killed run for this output left
            # refuse before reading anything; atomic_output_dir checks again at the end
            contained = ([("the recipe's directory", self.source.path.absolute().parent)]
                         if self.source.path is not None else [])
            check_output(out, self._local_inputs(), force=options.force, directory=True,
                         contained=contained)
        if self.kind.runner is not None:
            return self._run_whole(out)
        try:
            self.max_shard = parse_size(recipe.output.max_shard_size)
        except ValueError as exc:
            raise RecipeError(f"{self.source.name}: output.max_shard_size: {exc}") from None
        held_out = read_held_out(options.tune.text) if options.tune is not None else None
        texts = (self._in_recipe(calibration_texts, recipe.calibration, self._near())
                 if calibrates(recipe) and not planning_only else None)
        with ExitStack() as stack:
            models, plan = self._plan(stack)
            if planning_only:
                sizes = estimate(plan, source_bytes(models),
                                 max(options.lookahead, options.workers))
                return BuildResult(plan, None, "none", estimate=sizes)
            converter = self._gguf_converter(plan)
            check_output_apart(out, [(f"input model {m.label}", m.path) for m in models])
            return self._write(out, models, plan, held_out, texts, converter)

    # --- stages --------------------------------------------------------------------------

    def _check_kind(self, planning_only: bool) -> None:
        """What the options ask that this kind cannot do, before any model is read."""
        options, kind = self.options, self.kind
        what = f"{self.source.name} is kind: {kind.name}"
        if options.tune is not None:
            if not kind.tunable:
                tunable = " and ".join(k.name for k in KINDS if k.tunable)
                raise RecipeError(f"--tune-on: only {tunable} recipes have a merge to tune; "
                                  f"{what}")
            if planning_only:
                raise RecipeError("--tune-on builds the model to score it; it cannot be a dry "
                                  "run")
            check_options(options.tune)
        if options.gguf is not None and not planning_only:
            check_outtype(options.gguf)
            if not kind.gguf:
                kinds = ", ".join(k.name for k in KINDS if k.gguf)
                raise RecipeError(f"--gguf: a {kind.name} output runs moemerge's own modeling "
                                  f"code, which llama.cpp does not know; GGUF is written for "
                                  f"these kinds only: {kinds}")

    def _plan(self, stack: ExitStack) -> tuple[list[SourceModel], Plan]:
        with self.stage("planning") as found:  # reading every model's header
            models, plan = open_and_plan(self.recipe, self.source.dir,
                                         allow_pickle=self.options.allow_pickle, stack=stack)
            plan.decided_later = decided_later(self.recipe)
            found(f"{plural(len(models), 'model')}, {plural(len(plan.jobs), 'output tensor')}, "
                  f"{human_bytes(plan.total_bytes)}")
        for message in [*self._override_warnings(models, plan), *plan.notes]:
            self.warn(message)
        return models, plan

    def _gguf_converter(self, plan: Plan) -> list[str] | None:
        """Before any tensor is read: the converter's command, or why there is none."""
        if self.options.gguf is None:
            return None
        check_layout_converts(plan.config)
        if self.recipe.output.experts == FUSED:
            raise RecipeError("--gguf: llama.cpp's converter reads per-expert tensors; build with "
                              "output.experts: classic (the default) for a GGUF")
        return find_converter(self.options.llama_cpp)

    def _write(self, out: Path, models: list[SourceModel], plan: Plan,
               held_out: dict[str, str] | None, texts: dict | None,
               converter: list[str] | None) -> BuildResult:
        options, recipe, kind = self.options, self.recipe, self.kind
        tensors = CheckedTensors(models, strict=options.strict,
                                 allow_non_finite=options.allow_non_finite, warn=self.warn)
        tokenizer_dir = models[kind.tokenizer(recipe)].path
        calibration = None
        built = f"the output {out}"  # what tuning and calibration run: its positions, its rows
        if options.tune is not None:
            check_seq_len(options.tune.seq_len, "--tune-seq-len", plan.config, built)
        if texts is not None:
            check_seq_len(recipe.calibration.seq_len, "calibration.seq_len", plan.config, built)
        tokenizer = (load_tokenizer(tokenizer_dir)  # once, for tuning and calibration alike
                     if options.tune is not None or texts is not None else None)
        if tokenizer is not None:  # before any forward pass
            check_tokenizer_fits(tokenizer, vocab_rows(plan.config), tokenizer_dir, built)
        if options.tune is not None:  # every check before the first tensor is read
            tunable_jobs(plan)
            check_length(tokenizer, held_out, options.tune)
        if texts is not None:  # windows and targets (loss targets run each expert)
            with self.stage("preparing the calibration text"):
                calibration = self._in_recipe(
                    kind.load("calibration_set"), recipe.calibration, texts, tokenizer,
                    expert_models(recipe, models))
        # once per build, after every check: tuning changes merge parameters, never routers
        make_router = router_maker(recipe, models)
        recipe_text, tuning = self.source.text, None

        def write(dest: Path, plan: Plan, recipe: AnyRecipe, recipe_text: str,
                  what: str = "merging") -> None:
            planned = [(j.output, j.dtype, tuple(j.shape)) for j in plan.jobs]
            with ShardedWriter(dest, planned, max_shard_bytes=self.max_shard) as writer:
                lookahead = max(options.lookahead, options.workers)
                jobs = run_jobs(plan, tensors.load, make_router, recipe.seed,
                                lookahead=options.lookahead, workers=options.workers,
                                device=self.device, stored=tensors.stored,
                                pool_bytes=window_bytes(plan, source_bytes(models), lookahead))
                for job, tensor in self.stage.bar(what, jobs, plan.total_bytes, len(plan.jobs),
                                                  lambda item: item[0].nbytes):
                    tensors.put(writer, job, tensor)
            self._finish(dest, plan, recipe, recipe_text, tokenizer_dir)

        # tuning writes a draft first: an untuned copy
        size = plan.total_bytes * (2 if options.tune is not None else 1)
        with atomic_output_dir(out, force=options.force, size=size) as tmp:
            if options.tune is not None:
                recipe, recipe_text, tuning = tune_recipe(
                    tmp / "untuned",
                    lambda draft: write(draft, plan, recipe, recipe_text,
                                        "merging an untuned draft"),
                    plan, tensors.load, tokenizer, held_out, options.tune, seed=recipe.seed,
                    recipe_text=recipe_text, source=self.source.name, report=self.on_candidate)
                plan = make_plan(recipe, models)
                (tmp / TUNING_FILE).write_text(tuning_json(tuning, options.tune))
            write(tmp, plan, recipe, recipe_text)
            if calibration is not None:  # fitted on the model just written (routers: placeholders)
                stats: dict = {}
                if getattr(recipe, "experts_per_token", None) == "auto":
                    recipe, recipe_text, plan, routers, stats = self._choose_top_k(
                        tmp, models, recipe_text, calibration, tokenizer_dir)
                else:
                    with self.stage("calibrating the routers") as found:
                        routers = calibrated_routers(recipe, plan, tmp, calibration, stats)
                        found(plural(len(routers), "router"))
                for name, router in routers.items():
                    tensors.check_output(name, router)
                overwrite_tensors(tmp, routers)
                if stats:  # what `moemerge extend` refits the routers from
                    keep_statistics(tmp, stats, calibration.ids.shape[0])
            full = options.verify == "full" or (options.verify == "auto"
                                                and plan.total_bytes <= FULL_LOAD_LIMIT)
            loaded = None
            if full:
                with self.stage("checking the output") as found:
                    found(loaded := check_loads(tmp, finite=not options.allow_non_finite))
        written = None
        if converter is not None:
            timeout = options.gguf_timeout or default_timeout(out)
            with self.stage("writing the GGUF"):
                written = write_gguf(out, options.gguf, converter, timeout)
        return BuildResult(plan, out, "full" if full else "structure", tuning, gguf=written,
                           loaded=loaded)

    def _choose_top_k(self, dest: Path, models: list[SourceModel], recipe_text: str,
                      calibration, tokenizer_dir: Path):
        """`experts_per_token: auto`: the routers calibrated under each k and k chosen on the
        model at `dest` (routing/top_k.py); its config, recipe copy and card written again with
        it. -> (recipe, its text, plan, the chosen k's routers and their statistics)."""
        recipe, fitted = self.recipe, {}  # k -> (its routers, their statistics)

        def calibrated_with(k: int):
            stats: dict = {}
            model, routers = calibrated_model(recipe, dest, calibration, stats,
                                              num_experts_per_tok=k)
            fitted[k] = (routers, stats)
            return model

        with self.stage("calibrating the routers and choosing experts per token") as found:
            choice = choose_top_k(calibrated_with, held_out_ids(calibration.ids),
                                  recipe.num_experts)
            routers, stats = fitted[choice.chosen]
            recipe_text = chosen_recipe_text(recipe_text, choice)
            recipe = parse_recipe(yaml.safe_load(recipe_text), self.source.name)
            plan = make_plan(recipe, models)
            self._finish(dest, plan, recipe, recipe_text, tokenizer_dir)
            found(choice.describe())
        return recipe, recipe_text, plan, router_tensors(plan, routers), stats

    def _finish(self, dest: Path, plan: Plan, recipe: AnyRecipe, recipe_text: str,
                tokenizer_dir: Path) -> None:
        """Everything beside the tensors: config, tokenizer, modeling code, recipe, card."""
        (dest / "config.json").write_text(json.dumps(plan.config, indent=2) + "\n")
        copy_side_files(tokenizer_dir, dest, SIDE_FILES)
        if plan.tokenizer is not None:  # a merged vocabulary (plan/tokens.py)
            (dest / "tokenizer.json").write_text(plan.tokenizer)
        if self.kind.remote_code or "auto_map" in plan.config:  # (a DeepSeek-MoE layout)
            copy_modeling_code(dest)
        (dest / RECIPE_COPY).write_text(recipe_text)
        (dest / "README.md").write_text(model_card(recipe, plan, recipe_text, self.source.dir))
        check_structure(dest, plan)

    def _run_whole(self, out: Path | None) -> BuildResult:
        """A kind with no plan (`shrink`, `stages`): its runner does the whole build."""
        if self.options.dry_run or out is None:  # (--tune-on: refused by _check_kind)
            raise RecipeError(f"{self.source.name}: kind: {self.kind.name} has no dry run: what "
                              "it writes is chosen from what it reads as it runs (a shrink's "
                              "statistics, a stage's inputs); give an output directory")
        done = self._in_recipe(self.kind.load("runner"), self.recipe, out,
                               recipe_dir=self._near(), recipe_text=self.source.text,
                               options=self.options, progress=self.progress, warn=self.warn)
        verified = "structure" if self.options.verify == "structure" else "full"
        return BuildResult(Plan([], [], {}), out, verified, whole=done)

    # --- helpers ---------------------------------------------------------------------------

    def _near(self) -> Path:
        return self.source.dir if self.source.dir is not None else Path.cwd()

    def _in_recipe(self, fn, *args, **kwargs):
        """fn(*args), its RecipeError prefixed with the recipe it is about."""
        try:
            return fn(*args, **kwargs)
        except RecipeError as exc:
            raise RecipeError(f"{self.source.name}: {exc}") from None

    def _local_inputs(self) -> list[tuple[str, Path]]:
        """(what, path) of every local input: the recipe file, the --tune-on text and every
        model reference (and LoRA adapter) that names an existing local directory."""
        found = [("the recipe", self.source.path)] if self.source.path is not None else []
        if self.options.tune is not None:
            found.append(("the --tune-on text", Path(self.options.tune.text)))
        for label, ref in labelled_refs(self.recipe):
            named = [(f"input model {label}", ref.model)]
            if getattr(ref, "lora", None):
                named.append((f"the adapter of input model {label}", ref.lora))
            for what, path in named:
                for candidate in (self._near() / path, Path(path).expanduser()):
                    if candidate.is_dir():
                        found.append((what, candidate))
        return found

    def _override_warnings(self, models: list[SourceModel], plan: Plan) -> list[str]:
        """Override `layers:` name the output's layers: a slices merge's stack, else the
        models' (bridged: the deepest)."""
        merge = getattr(self.recipe, "merge", None)
        layers = (plan.config["num_hidden_layers"] if getattr(self.recipe, "slices", None)
                  else max(m.config["num_hidden_layers"] for m in models))
        return override_layer_warnings(merge, layers) if merge is not None else []


def _warn(message: str) -> None:
    """warnings.warn, attributed to the first caller outside moemerge (the user's line)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("moemerge."):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)
