"""The recipe copy of an MoE being extended: what it allows, the new experts the options name,
and the copy the output gets.

The output's copy is the old recipe with each new expert appended to `experts` and its text to
`calibration.data`, so `moemerge build` of it makes the extended model from scratch. With
--keep-shared, where the merge depends on the expert set, a new expert gets `weight: 0`: it
takes no part in the non-FFN merge (or a shared `average` expert), which then stays as built;
without it the new expert has its ordinary weight and extend merges those tensors again
(remerge.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from moemerge.errors import CheckpointError, RecipeError
from moemerge.io.atomic import RECIPE_COPY
from moemerge.loading import read_recipe_copy
from moemerge.recipe.load import parse_recipe
from moemerge.recipe.models import MoERecipe
from moemerge.words import plural

REBUILD = "rebuild it with `router.init: calibrate` (a `calibration` block, one text per expert)"


@dataclass
class NewExpert:
    name: str
    path: Path  # the dense model, absolute
    text: str  # its calibration text (a path, absolute; "" when the routers are not calibrated)


def recipe_copy(moe: Path, rebuild: str = REBUILD) -> tuple[dict, object]:
    """(the recipe copy as a mapping, parsed); a model without one was not built by moemerge."""
    data = read_recipe_copy(moe)
    if not data:
        raise CheckpointError(f"{moe}: no {RECIPE_COPY}: not a model `moemerge build` made, so "
                              f"its experts and routers are unknown; {rebuild}")
    return data, parse_recipe(data, str(moe / RECIPE_COPY))


def built_recipe(moe: Path) -> tuple[dict, MoERecipe]:
    """(the recipe copy as a mapping, parsed); refuses what extend cannot grow."""
    data, recipe = recipe_copy(moe)
    if not isinstance(recipe, MoERecipe):
        kind = f"{recipe.kind} ({getattr(recipe, 'assembly', '')})".replace(" ()", "")
        raise RecipeError(f"{moe}: extend grows a token_routed kind: moe; this one is {kind}")
    if recipe.router.init != "calibrate" or recipe.calibration is None:
        raise RecipeError(f"{moe}: its routers were not calibrated (router.init: "
                          f"{recipe.router.init}), so no statistics were kept; {REBUILD}")
    if recipe.include_base_expert:
        raise RecipeError(f"{moe}: built with include_base_expert (the base is the last "
                          "expert); extend appends experts after the others and does not take it")
    if recipe.calibration.targets == "loss":
        raise loss_targets_error(moe)
    return data, recipe


def new_experts(paths: list[Path], names: list[str] | None, old: list[str]
                ) -> list[NewExpert]:
    """Each --expert with its name (--name, else its directory's), no text yet: what the
    checks against the MoE need, before any --calibration is asked for (`with_texts`)."""
    if not paths:
        raise RecipeError("give at least one --expert PATH")
    names = list(names or [Path(p).resolve().name for p in paths])
    if len(names) != len(paths):
        raise RecipeError(f"--name: {plural(len(names), 'name')} for "
                          f"{plural(len(paths), '--expert model')}")
    taken = [n for n in names if n in old or names.count(n) > 1]
    if taken:
        raise RecipeError(f"--name: {', '.join(sorted(set(taken)))} already names an expert "
                          f"(experts: {', '.join(old)}); give each new expert a new --name")
    _check_dirs(paths)
    return [NewExpert(n, Path(p).resolve(), "") for n, p in zip(names, paths, strict=True)]


def with_texts(new: list[NewExpert], texts: list[str] | None, *, need_text: bool = True
               ) -> list[NewExpert]:
    """`new` with each expert's calibration text (--calibration: `name=path`, or one bare path
    per expert in order). need_text=False: the routers are not calibrated, and --calibration
    is refused."""
    if not need_text:
        if texts:
            raise RecipeError("--calibration: this MoE's routers are not calibrated (no "
                              "`calibration` block in its recipe copy), so no text is read; "
                              "leave --calibration out")
        return new
    given = list(texts or [])
    named = dict(t.split("=", 1) for t in given if "=" in t)
    bare = [t for t in given if "=" not in t]
    if bare and len(bare) != len(new):
        raise RecipeError(f"--calibration: {plural(len(bare), 'text')} without a name for "
                          f"{plural(len(new), 'expert')}; give NAME=PATH for each")
    by_name = named | dict(zip([e.name for e in new], bare, strict=False))
    missing = [e.name for e in new if e.name not in by_name]
    if missing:
        raise RecipeError(f"--calibration: no text for {', '.join(missing)}: the routers are "
                          "refitted on each new expert's own text (--calibration NAME=PATH)")
    return [replace(e, text=str(Path(by_name[e.name]).resolve())) for e in new]


def _check_dirs(paths: list[Path]) -> None:
    for path in paths:
        if not Path(path).is_dir():
            raise CheckpointError(f"--expert {path}: no such model directory")


def loss_targets_error(moe: Path) -> RecipeError:
    return RecipeError(f"{moe}: calibrated on one mixed text (loss targets); an old row's "
                       "target for a new expert would need that expert's losses on the old "
                       f"text; {REBUILD}, naming each text after its expert (name=path)")


def depends_on_experts(recipe) -> list[str]:
    """What, among the shared (non-FFN) tensors, a new expert would change: every merge
    method but `base` (which copies the base) reads each expert, and so does an `average`
    shared expert (token_routed)."""
    methods = {recipe.merge.method, *(o.method for o in recipe.merge.overrides if o.method)}
    found = [f"merge method {m}" for m in sorted(methods - {"base"})]
    average = getattr(recipe, "shared_expert", None) == "average"
    return found + (["shared_expert: average"] if average else [])


def extended_recipe_text(data: dict, new: list[NewExpert], keep_shared: bool) -> str:
    """The recipe copy for the output (YAML; the old copy's comments are not kept)."""
    data = dict(data)
    experts = list(data["experts"])
    for e in new:
        entry: dict = {"model": str(e.path), "name": e.name}
        if keep_shared:
            entry["weight"] = 0
        experts.append(entry)
    data.update(experts=experts)
    if data.get("calibration"):  # routers not calibrated: no text to add
        calibration = dict(data["calibration"])
        old = calibration["data"]
        calibration["data"] = [*([old] if isinstance(old, str) else old),
                               *(f"{e.name}={e.text}" for e in new)]
        data.update(calibration=calibration)
    return yaml.safe_dump(data, sort_keys=False)
