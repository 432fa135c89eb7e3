"""The runner of `kind: stages` (recipe/stages.py): each stage built in order by `api.build`, its
references to earlier stages made the paths of their outputs. The output stage is written to
OUT; every other stage to `<OUT>.stages/<name>`, a whole model like any output (atomic, with its
recipe copy and card), so a run stopped between stages leaves finished stages and no OUT."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import yaml

from moemerge.api import RecipeSource, build
from moemerge.build_options import BuildOptions
from moemerge.errors import OutputError, RecipeError
from moemerge.recipe.kinds import kind_of
from moemerge.recipe.load import parse_recipe
from moemerge.recipe.stages import StagesRecipe


@dataclass
class StagesBuilt:
    output: Path
    stages: dict[str, Path]  # every other stage's output, by name
    verb: ClassVar[str] = "built"  # what `build` prints before the output's path

    def summary(self) -> str:
        """What `build` prints after the output's path."""
        if not self.stages:
            return "1 stage"
        return (f"{len(self.stages) + 1} stages; the others in {self.output.name}.stages/: "
                + ", ".join(self.stages))


def stage_outputs(recipe: StagesRecipe, out: Path) -> dict[str, Path]:
    """Where each stage but the output stage is written."""
    where = out.parent / f"{out.name}.stages"
    return {s.name: where / s.name for i, s in enumerate(recipe.stages)
            if i != recipe.output_index}


def build_stages(recipe: StagesRecipe, out: Path, *, recipe_dir: Path | None, recipe_text: str,
                 options: BuildOptions, progress: bool, warn) -> StagesBuilt:
    # (api.py refuses a dry run and --tune-on: a stage is planned from earlier stages' outputs)
    final = recipe.output_index
    if options.gguf is not None:  # before any stage is built
        kind = kind_of(parse_recipe(recipe.stages[final].recipe))
        if not kind.gguf:
            raise RecipeError(f"--gguf: the output stage is kind: {kind.name}, whose output "
                              "llama.cpp does not know")
    outputs = stage_outputs(recipe, out)
    if not options.force:  # refuse before the first stage is built
        taken = [p for p in [out, *outputs.values()] if p.exists()]
        if taken:
            raise OutputError(f"{taken[0]} already exists; pass --force to replace it (a stages "
                              f"recipe writes {out} and {out.name}.stages/ beside it)")
    made = {name: str(path.absolute()) for name, path in outputs.items()}
    for i in recipe.order():
        stage = recipe.stages[i]
        data = recipe.stage_recipe(i, made)
        where = f"stages[{i}]" + (f" ({stage.name})" if stage.name else " (the output)")
        parsed = parse_recipe(data, where)  # checked whole already: only references changed
        last = i == final
        dest = out if last else outputs[stage.name]
        build(parsed, dest, options.model_copy(update={"gguf": options.gguf if last else None}),
              source=RecipeSource(yaml.safe_dump(data, sort_keys=False), recipe_dir),
              progress=progress, warn=warn)
    return StagesBuilt(out, outputs)
