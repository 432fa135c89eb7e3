"""`moemerge import-mergekit`: a mergekit-yaml or mergekit-moe config as a moemerge recipe.

The recipe builds the same model, within the parity figures of
benchmarks/results/mergekit_parity.md: where the tools' conventions differ the recipe sets the
options that give mergekit's result. What cannot be carried without changing the model is an
error naming the key; what can be dropped without changing the weights (memory options, a chat
template) is listed in the recipe's comment block with the reason.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import yaml

from moemerge.bounds import MAX_STAGES
from moemerge.errors import RecipeError
from moemerge.recipe.load import parse_recipe
from moemerge.recipe.mergekit.dense import convert_yaml
from moemerge.recipe.mergekit.moe import convert_moe
from moemerge.recipe.mergekit.problems import Problems
from moemerge.recipe.tree import replaced

MAX_DOCUMENTS = MAX_STAGES  # a document per stage


@dataclass
class Imported:
    kind: str  # "mergekit-yaml", "mergekit-moe" or "mergekit-multi"
    recipe: dict
    notes: list[str] = field(default_factory=list)


def convert_documents(documents: list, source: str = "<config>") -> Imported:
    """One document: `convert`. Several (mergekit-multi): a `kind: stages` recipe, a stage per
    document; a document's `name` names its stage (later documents read its output by that
    name), the one without a name is the output, as mergekit-multi has it (mergekit-mega's
    `out_path` documents likewise: `_out_paths_named`)."""
    if not documents:
        raise RecipeError(f"{source}: holds no config")
    if len(documents) == 1:
        return convert(documents[0], source)
    if len(documents) > MAX_DOCUMENTS:
        raise RecipeError(f"{source}: {len(documents)} documents; a mergekit-multi config has "
                          f"at most {MAX_DOCUMENTS} documents (each a stage, a whole model "
                          "built in turn)")
    if any(not isinstance(d, dict) for d in documents):
        i = next(i for i, d in enumerate(documents) if not isinstance(d, dict))
        raise RecipeError(f"{source}, document {i + 1}: not a mergekit config (a YAML mapping)")
    documents = _out_paths_named(documents, source)
    stages, notes, problems = [], [], Problems()
    for i, document in enumerate(documents):
        with problems.check():  # every document's problems at once
            where = f"{source}, document {i + 1}"
            name = document.get("name")
            if name is not None and not isinstance(name, str):
                raise RecipeError(f"{where}: name: a stage name is a string, got {name!r}")
            one = convert({k: v for k, v in document.items() if k != "name"}, where)
            stages.append({**({"name": name} if name else {}), "recipe": one.recipe})
            notes += [f"{name or 'the output stage'}: {note}" for note in one.notes]
    problems.raise_any()
    recipe = {"kind": "stages", "stages": stages}
    parse_recipe(recipe, f"{source} (imported)")
    return Imported("mergekit-multi", recipe, notes)


def _out_paths_named(documents: list[dict], source: str) -> list[dict]:
    """mergekit-mega's form of a multi-document config: each document writes to its
    `out_path`, and later ones read that path. Each becomes a stage named after the path's last
    part (the last document the output), and every reference to the path that name."""
    paths = [d.get("out_path") for d in documents]
    if not any(paths):
        return documents
    for i, path in enumerate(paths):
        if path is not None and not isinstance(path, str):
            raise RecipeError(f"{source}, document {i + 1}: out_path: a path is a string, got "
                              f"{str(path)[:60]!r}")
    names = {path: path.rstrip("/").rsplit("/", 1)[-1] for path in paths[:-1] if path}
    out = []
    for i, document in enumerate(documents):
        document = replaced({k: v for k, v in document.items() if k != "out_path"},
                            lambda _key, text: names.get(text, text))
        if paths[i] and i < len(documents) - 1 and "name" not in document:
            document["name"] = names[paths[i]]
        out.append(document)
    return out


def convert(data: object, source: str = "<config>") -> Imported:
    """Translate parsed mergekit config data; the result is validated as a moemerge recipe."""
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: not a mergekit config (a YAML mapping)")
    notes: list[str] = []
    is_moe = "experts" in data or "gate_mode" in data
    try:
        recipe = convert_moe(data, notes) if is_moe else convert_yaml(data, notes)
    except RecipeError as exc:
        raise RecipeError(f"{source}: {exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:
        raise RecipeError(f"{source}: malformed mergekit config ({type(exc).__name__}: "
                          f"{exc})") from None
    parse_recipe(recipe, f"{source} (imported)")  # every error at once, before it is written
    return Imported("mergekit-moe" if is_moe else "mergekit-yaml", recipe, notes)


def render(imported: Imported, source: str) -> str:
    """The recipe as YAML under a comment block: where it came from, what was not carried."""
    lines = [f"# Imported from {source} ({imported.kind}) by `moemerge import-mergekit`."]
    if imported.notes:
        lines.append("# Not carried, or carried differently:")
        for note in imported.notes:
            lines += textwrap.wrap(note, 96, initial_indent="#   - ", subsequent_indent="#     ")
    else:
        lines.append("# Everything in the config was carried.")
    body = yaml.safe_dump(imported.recipe, sort_keys=False, allow_unicode=True,
                          default_flow_style=None, width=100)
    return "\n".join(lines) + "\n" + body
