"""`moemerge shrink` / `kind: shrink`: fewer experts per layer for a token-routed MoE.

One forward pass of the MoE over calibration text gives every layer's expert statistics
(stats.py); `prune` keeps the K most salient experts (prune.py) or `merge` clusters them into
K groups and averages each (merge.py); the checkpoint is written tensor by tensor in the input's
own layout under the output rule (write.py); router repair then refits every router to the
original model's routing (repair.py), and the card records what happened (card.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import yaml

from moemerge.architectures.forms import layout_of, moe_names
from moemerge.built.shrink.card import SHRINK_FILE, readme, shrink_json
from moemerge.built.shrink.merge import merge
from moemerge.built.shrink.prune import Grouping, prune
from moemerge.built.shrink.repair import repair_routers
from moemerge.built.shrink.stats import collect_stats
from moemerge.built.shrink.write import check_group_sizes, shrunk_config, shrunk_tensors
from moemerge.data import read_domains
from moemerge.errors import CheckpointError, RecipeError
from moemerge.eval.perplexity import load_tokenizer
from moemerge.finish.verify import FULL_LOAD_LIMIT, check_loads
from moemerge.io.atomic import (
    RECIPE_COPY,
    SIDE_FILES,
    atomic_output_dir,
    copy_side_files,
    sweep_output,
)
from moemerge.io.outputs import check_output, local_inputs
from moemerge.io.reader import CheckpointReader, read_config
from moemerge.io.resolve import resolve_model
from moemerge.io.tensor_list import written_in
from moemerge.io.writer import ShardedWriter, finite, overwrite_tensors
from moemerge.loading import check_seq_len, check_tokenizer_fits, load_pretrained, vocab_rows
from moemerge.progress import Stages
from moemerge.recipe.shrink import ShrinkRecipe
from moemerge.routing.calibration import calibration_windows

__all__ = ["Shrunk", "input_model", "shrink"]


@dataclass
class Shrunk:
    before: int  # experts per layer in the input
    kept: int
    groupings: dict[int, Grouping]
    notes: list[str] = field(default_factory=list)
    bytes: int = 0

    verb: ClassVar[str] = "shrunk"  # what `build` prints before the output's path

    def summary(self) -> str:
        """What `build` prints after the output's path."""
        return f"{self.kept} of {self.before} experts per layer, {self.bytes / 2**20:.1f} MiB"


def input_model(recipe: ShrinkRecipe, recipe_dir: Path) -> Path:
    """The MoE's directory: relative to the recipe's directory first, else as given."""
    ref = recipe.model.model
    near = Path(recipe_dir) / ref
    return resolve_model(str(near) if near.exists() else ref, recipe.model.revision,
                         near=(Path(recipe_dir),))


def _check(moe: Path, config: dict, recipe: ShrinkRecipe):
    """(layout, experts per layer, K): refuses a dense model and a K the MoE cannot have."""
    layout = layout_of(config)
    if layout is None:
        raise CheckpointError(
            f"{moe}: model_type {config.get('model_type')!r} is not a token-routed MoE "
            f"({moe_names()}); shrink removes experts from one of those")
    before = layout.expert_count(config)
    kept = recipe.kept(before)
    if kept > before:
        raise RecipeError(f"experts: {kept} is more than the {before} experts per layer of "
                          f"{moe}; give at most {before}")
    return layout, before, kept


def _windows(recipe: ShrinkRecipe, moe: Path, config: dict, recipe_dir: Path):
    domains = read_domains(recipe.calibration.data, text_field=recipe.calibration.text_field,
                           what="calibration.data", near=recipe_dir)
    texts = {name: domain.documents for name, domain in domains.items()}
    check_seq_len(recipe.calibration.seq_len, "calibration.seq_len (--seq-len)", config, moe)
    tokenizer = load_tokenizer(moe)
    check_tokenizer_fits(tokenizer, vocab_rows(config), moe, moe)  # before the forward pass
    ids, _, _ = calibration_windows(recipe.calibration, texts, tokenizer)
    return ids


def _groupings(stats, recipe: ShrinkRecipe, kept: int) -> dict[int, Grouping]:
    choose = prune if recipe.method == "prune" else merge
    return {layer: choose(s, kept, recipe.saliency) for layer, s in stats.items()}


def run(recipe: ShrinkRecipe, out: Path, *, recipe_dir: Path, recipe_text: str, options,
        progress: bool, warn) -> Shrunk:
    """`build` of a `kind: shrink` recipe (its kind's runner, recipe/kinds.py; api.py refuses
    a dry run and --tune-on)."""
    return shrink(recipe, out, recipe_dir=recipe_dir, recipe_text=recipe_text,
                  force=options.force, verify=options.verify != "structure", progress=progress)


def shrink(recipe: ShrinkRecipe, out: Path, *, recipe_dir: Path, recipe_text: str,
           force: bool = False, verify: bool = True, progress: bool = False) -> Shrunk:
    """Write `recipe`'s MoE with fewer experts to `out` (checked against the output rule by
    the caller; written atomically here); `progress` names each stage on stderr."""
    stage = Stages(progress)
    moe = input_model(recipe, recipe_dir)
    sweep_output(out)  # what a killed shrink left, even if this one fails
    check_output(out, [("the input model", moe), *local_inputs(
        "the calibration text", recipe.calibration.data, near=[Path(recipe_dir)])],
        force=force, directory=True)
    config = read_config(moe)
    layout, before, kept = _check(moe, config, recipe)
    ids = _windows(recipe, moe, config, recipe_dir)  # a bad calibration path fails before any work
    new_config, notes = shrunk_config(config, layout, kept)
    if kept == before:
        notes.append(f"{kept} of {before} experts kept: nothing removed, routers unchanged")
    with CheckpointReader(moe) as reader:
        with stage("routing statistics on the calibration text"):
            model = load_pretrained("AutoModelForCausalLM", moe, dtype="auto").eval()
            stats = collect_stats(model, reader, layout, config, ids, recipe.merge_sample)
            del model
        groupings = _groupings(stats, recipe, kept)
        check_group_sizes(groupings, recipe.merge_method)
        # the input's own form, unless the recipe says which (output.experts)
        form = (recipe.output.experts if "experts" in recipe.output.model_fields_set
                else reader.form)
        tensors = written_in(form, layout,
                             shrunk_tensors(reader, layout, groupings, recipe.merge_method))
        size = sum(t.dtype.itemsize * math.prod(t.shape) for t in tensors)
        with atomic_output_dir(out, force=force, size=size) as tmp:
            with stage("writing"):
                with ShardedWriter(tmp, [(t.name, t.dtype, t.shape) for t in tensors],
                                   metadata={"moemerge_shrunk_from": moe.name}) as writer:
                    for t in tensors:
                        writer.write(t.name, finite(t.name, t.make().contiguous(),
                                                    f"{moe}'s experts merged or kept"))
                (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
                copy_side_files(moe, tmp, SIDE_FILES)
            if recipe.repair and kept < before:
                with stage("repairing the routers"):
                    shrunk = load_pretrained("AutoModelForCausalLM", tmp, dtype="auto").eval()
                    routing = {layer: s.routing for layer, s in stats.items()}
                    routers = repair_routers(shrunk, ids, routing, groupings)
                    overwrite_tensors(tmp, {layout.router_name(layer): w
                                            for layer, w in routers.items()})
                    del shrunk
            tokens = ids.shape[0] * (ids.shape[1] - 1)
            (tmp / RECIPE_COPY).write_text(recipe_text)
            (tmp / SHRINK_FILE).write_text(shrink_json(moe, recipe, before, groupings, stats,
                                                       tokens, notes))
            (tmp / "README.md").write_text(readme(moe, recipe, before, kept, groupings, notes))
            if verify and size <= FULL_LOAD_LIMIT:
                with stage("checking that the output loads in transformers"):
                    check_loads(tmp)
    return Shrunk(before, kept, groupings, notes, size)


def recipe_text_of(recipe: ShrinkRecipe, moe: Path, data: list[str]) -> str:
    """The recipe copy of a `moemerge shrink` run: its options as a `kind: shrink` recipe,
    paths absolute so that `moemerge build` of the copy reads the same files."""
    fields = recipe.model_dump(exclude_defaults=True, exclude={"model", "calibration"})
    calibration = recipe.calibration.model_dump(exclude_defaults=True, exclude={"data"})
    text = {"kind": "shrink", "model": str(moe.absolute()), **fields,
            "calibration": {"data": [_absolute(d) for d in data], **calibration}}
    return ("# written by `moemerge shrink`; `moemerge build` of this file makes the same "
            "model\n" + yaml.safe_dump(text, sort_keys=False))


def _absolute(spec: str) -> str:
    """A --data spec with its path made absolute (`name=path` keeps its name)."""
    name, sep, path = spec.partition("=") if "=" in spec and not Path(spec).exists() else \
        ("", "", spec)
    return f"{name}{sep}{Path(path).absolute()}" if Path(path).exists() else spec
