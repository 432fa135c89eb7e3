"""`moemerge demo`: the main job end to end on tiny experts made offline.

workdir/
  .moemerge-demo       marks the directory as the demo's own, so a rerun may replace it
  toy/                 base/, experts/<domain>/, data/<domain>.eval.txt (copied from the cache)
  toy_moe.yaml         the bundled recipes, next to toy/ so their relative paths resolve
  toy_merge.yaml
  toy_seq_routed.yaml
  moe/                 the built Mixtral (Branch-Train-Mix)
  merged/              the dense TIES merge of the same experts, for comparison
  seq/                 the sequence-routed MoE (task-vector routing, no router training)
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path

from rich.console import Console

from moemerge.errors import OutputError, RecipeError
from moemerge.io.atomic import atomic_output_dir
from moemerge.io.outputs import check_output
from moemerge.terminal_tables import Fitted

MARKER = ".moemerge-demo"
RECIPES = {"moe": "toy_moe.yaml", "merged": "toy_merge.yaml", "seq": "toy_seq_routed.yaml"}
PROMPT_TOKENS = 32  # each window: a prompt (sequence-routed models route on it), then the rest


def preset_spec(name: str, others: tuple[str, ...] = (), real: bool = False):
    """The toy set of preset `name` (with `real`, also the real experts' 'smollm2-experts' and
    'gemma3-experts'); `others` are more names the caller accepts (said in the error)."""
    from moemerge.toy import DEMO, TINY
    from moemerge.toy.real_experts import GEMMA3_MATH, REAL

    presets = {"demo": DEMO, "tiny": TINY}
    if real:
        presets |= {"smollm2-experts": REAL, "gemma3-experts": GEMMA3_MATH}
    if name not in presets:
        raise RecipeError(f"--preset: must be one of {', '.join([*presets, *others])}, got "
                          f"{name!r}")
    return presets[name]


def bundled_recipe(name: str) -> Path:
    path = Path(str(resources.files("moemerge") / "recipes" / name))
    if not path.is_file():
        raise RecipeError(f"bundled recipe {name} is missing from the installation ({path})")
    return path


def materialise_toy_set(spec, directory: Path, *, force: bool = False, progress: bool = True):
    """Copy the (cached, made on first use) toy experts, or the real experts of a
    `RealExpertSpec`, into `directory`."""
    from moemerge.toy import cached_toy_experts
    from moemerge.toy.real_experts import RealExpertSpec, cached_real_experts

    _check_apart(directory, force)
    if isinstance(spec, RealExpertSpec):
        toyset = cached_real_experts(spec, progress=progress)
    else:
        toyset = cached_toy_experts(spec, progress=progress)
    _copy_parts({part: toyset.root / part for part in ("base", "experts", "data")}, directory,
                force)
    return toyset


def materialise_lora_set(directory: Path, *, force: bool = False, progress: bool = True):
    """Copy the (cached, made on first use) LoRA experts of the SmolLM2 base into `directory`:
    base/, adapters/<domain>/, data/."""
    from moemerge.toy.real_lora import LORA, cached_lora_experts

    _check_apart(directory, force)
    loraset = cached_lora_experts(LORA, progress=progress)
    _copy_parts({part: loraset.root / part for part in ("base", "adapters", "data")}, directory,
                force)
    return loraset


def materialise_pretrained(name: str, directory: Path, *, force: bool = False) -> Path:
    """Copy the (cached, converted on first use) real pretrained base into `directory`/base."""
    from moemerge.toy.pretrained import cached_pretrained

    _check_apart(directory, force)
    _copy_parts({"base": cached_pretrained(name)}, directory, force)
    return directory / "base"


def _check_apart(directory: Path, force: bool) -> None:
    """Before any work: the output rule, with the toy cache as the input it must stay apart
    from."""
    from moemerge.cache import cache_root

    check_output(directory, [("the toy cache", cache_root())], force=force, directory=True)


def _copy_parts(parts: dict[str, Path], directory: Path, force: bool) -> None:
    """Each source directory copied to `directory`/name, the whole written atomically."""
    size = sum(f.stat().st_size for p in parts.values() for f in p.rglob("*") if f.is_file())
    with atomic_output_dir(directory, force=force, size=size) as tmp:
        for name, source in parts.items():
            shutil.copytree(source, tmp / name)


def _claim_workdir(workdir: Path) -> None:
    if workdir.exists() and not (workdir / MARKER).exists():
        raise OutputError(
            f"{workdir} already exists and was not made by `moemerge demo`; choose another "
            "--workdir"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).touch()


def run_demo(workdir: Path, *, preset_name: str = "demo", console: Console | None = None) -> Fitted:
    """Make the toy experts, build the bundled recipes, return the perplexity table."""
    from moemerge.api import build
    from moemerge.eval.perplexity import (
        MAX_TOKENS,
        load_tokenizer,
        perplexity_table,
        render_table,
        window_counts,
        windows_note,
    )

    console = console or Console(stderr=True)
    spec = preset_spec(preset_name)
    _claim_workdir(workdir)
    console.print(f"[bold]1/3[/] toy experts ({preset_name} preset; cached after the first run)")
    toyset = materialise_toy_set(spec, workdir / "toy", force=True)
    console.print("[bold]2/3[/] building the bundled recipes")
    built = {}
    for output, recipe_name in RECIPES.items():
        recipe = workdir / recipe_name
        shutil.copyfile(bundled_recipe(recipe_name), recipe)
        build(recipe, workdir / output, force=True)  # progress: bars, or lines in a pipe
        built[output] = workdir / output
        console.print(f"  built {workdir / output} from {recipe_name}")
    console.print(f"[bold]3/3[/] perplexity on held-out text of each domain (lower is better; "
                  f"each window's first {PROMPT_TOKENS} tokens are its prompt, not scored)")
    toy = workdir / "toy"
    models = {"base": toy / "base"}
    models |= {f"expert:{d}": toy / "experts" / d for d in toyset.experts}
    models |= {"merge (ties)": built["merged"], "moe (btx)": built["moe"],
               "moe (seq_routed)": built["seq"]}
    texts = {d: (toy / "data" / f"{d}.eval.txt").read_text() for d in toyset.experts}
    windows = {"seq_len": spec.seq_len, "max_tokens": MAX_TOKENS, "prompt_tokens": PROMPT_TOKENS}
    table = render_table(perplexity_table(models, texts, **windows),
                         title=f"perplexity per domain ({workdir})")
    # the toy models share one tokenizer, so one count holds for every row
    counts = window_counts(load_tokenizer(toy / "base"), texts, **windows)
    table.caption = windows_note(counts, **windows)
    return table
