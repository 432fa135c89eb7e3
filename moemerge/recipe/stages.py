"""`kind: stages`: several recipes built in one run, later stages reading earlier stages' outputs
by name (what mergekit-multi runs: `import-mergekit` writes one from a config of several YAML
documents).

    kind: stages
    stages:
      - name: code-math          # later stages name this stage's output as a model
        recipe: {kind: merge, ...}
      - recipe: {kind: moe, base_model: code-math, ...}   # the output stage: no name

The output stage is the one without a name, or else the one no other stage reads; the others
are written beside the output, each a whole model (`<OUT>.stages/<name>`), and built first.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from moemerge.bounds import MAX_STAGES
from moemerge.recipe.base import ModelRef, Strict
from moemerge.recipe.tree import replaced, strings

# recipe fields that hold model references (strings, or mappings with `model`)
MODEL_FIELDS = ("model", "base_model", "reference", "models", "experts", "sources", "slices")


class Stage(Strict):
    name: str | None = Field(default=None, min_length=1, max_length=200,
                             description="What later stages call this stage's output (as a "
                             "model); the output stage needs none.")
    recipe: dict = Field(description="A recipe of any other kind, as in a recipe file.")

    @field_validator("name")
    @classmethod
    def _a_directory_name(cls, name: str | None) -> str | None:
        if name in (".", "..") or any(c in (name or "") for c in "/\\\x00"):
            # OUT.stages/<name> must be a directory of its own, not elsewhere
            raise ValueError(f"{name[:80]!r}: a stage name is a directory name under "
                             "OUT.stages/ (no '/', '\\' or NUL, not '.' or '..')")
        return name


class StagesRecipe(Strict):
    kind: Literal["stages"]
    name: str | None = None
    stages: list[Stage] = Field(min_length=1)

    @field_validator("stages", mode="before")
    @classmethod
    def _at_most(cls, value: object) -> object:
        """Counted before any stage is validated: each is a whole model, built in turn."""
        if isinstance(value, list) and len(value) > MAX_STAGES:
            raise ValueError(f"{len(value)} stages; a stages recipe has at most {MAX_STAGES} "
                             "stages (each is a whole model, built in turn)")
        return value

    @model_validator(mode="after")
    def _valid(self) -> StagesRecipe:
        from moemerge.recipe.load import recipe_errors  # load builds its parser from the kinds

        names = [s.name for s in self.stages if s.name]
        problems = [f"stages: two stages are named {n!r}" for n in sorted(set(names))
                    if names.count(n) > 1]
        if len(self.stages) - len(names) > 1:
            problems.append("stages: more than one stage has no name; only the output stage "
                            "may go unnamed")
        for i, stage in enumerate(self.stages):
            if stage.recipe.get("kind") == "stages":
                problems.append(f"stages[{i}].recipe.kind: a stage is one recipe, not stages")
                continue
            problems += [f"stages[{i}].recipe.{e}" for e in recipe_errors(stage.recipe)]
        if not problems:
            problems += self._order_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def reads(self, index: int, names: set[str] | None = None) -> set[str]:
        """The stage names stage `index` reads as models (`names`: every stage's, when the
        caller has them)."""
        found: set[str] = set()
        _walk(self.stages[index].recipe, set(self._names()) if names is None else names,
              found.add)
        return found

    def order(self) -> list[int]:
        """Stage indices, each after every stage it reads (a depth-first walk with its own
        stack: a chain of stages is as long as the user makes it)."""
        index = {s.name: i for i, s in enumerate(self.stages) if s.name}
        names = set(index)
        reads = [[index[name] for name in sorted(self.reads(i, names))]
                 for i in range(len(self.stages))]
        done: list[int] = []
        finished: set[int] = set()
        for root in range(len(self.stages)):
            if root in finished:
                continue
            path, ahead = [root], [iter(reads[root])]  # the stages being visited, in order
            visiting = {root}
            while path:
                j = next(ahead[-1], None)
                if j is None:
                    finished.add(path[-1])
                    visiting.discard(path[-1])
                    done.append(path.pop())
                    ahead.pop()
                elif j in visiting:
                    raise ValueError(f"stages: a cycle: {self._cycle(path[path.index(j):])}")
                elif j not in finished:
                    path.append(j)
                    visiting.add(j)
                    ahead.append(iter(reads[j]))
        return done

    def _cycle(self, loop: list[int]) -> str:
        """'p -> q -> p'; a long cycle's middle left out."""
        names = [self.stages[j].name or "output" for j in loop]
        if len(names) > 8:
            return " -> ".join([*names[:4], "…", *names[-2:], names[0]]) + \
                f" ({len(names)} stages)"
        return " -> ".join([*names, names[0]])

    @property
    def output_index(self) -> int:
        unnamed = [i for i, s in enumerate(self.stages) if not s.name]
        if unnamed:
            return unnamed[0]
        names = set(self._names())
        read = set().union(*(self.reads(i, names) for i in range(len(self.stages))))
        sinks = [i for i, s in enumerate(self.stages) if s.name not in read]
        if len(sinks) != 1:
            unread = ", ".join(self.stages[i].name for i in sinks) or "none"
            raise ValueError("stages: which stage is the output? Leave its name out (the "
                             f"stages no other reads: {unread})")
        return sinks[0]

    @property
    def inputs(self) -> list[ModelRef]:
        """The models the stages read that no stage makes."""
        found: list[str] = []
        for stage in self.stages:
            _walk(stage.recipe, set(), found.append)
        names = set(self._names())
        return [ModelRef(model=m) for m in found if m not in names]

    def stage_recipe(self, index: int, outputs: dict[str, str]) -> dict:
        """Stage `index`'s recipe with every stage name it reads replaced by `outputs[name]`."""
        return _replaced(self.stages[index].recipe, outputs)

    def _names(self) -> list[str]:
        return [s.name for s in self.stages if s.name]

    def _order_problems(self) -> list[str]:
        try:
            self.order()
            _ = self.output_index
        except ValueError as exc:
            return [str(exc)]
        return []


def _walk(value: object, names: set[str], found) -> None:
    """found(model) for every model reference under `value` (all of them when `names` is
    empty, else those in `names`)."""
    for key, text in strings(value):
        if key in MODEL_FIELDS and (not names or text in names):
            found(text)


def _replaced(value: object, outputs: dict[str, str]) -> object:
    return replaced(value, lambda key, text: outputs[text]
                    if key in MODEL_FIELDS and text in outputs else text)
