"""`moemerge extract`: one expert of an MoE moemerge built, as a dense model; with --lora, that
expert or any dense model as a PEFT LoRA adapter on a base."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from moemerge.cli.app import app, out, reports_errors
from moemerge.errors import RecipeError


@app.command()
@reports_errors
def extract(
    model: Annotated[Path, typer.Argument(help="An MoE built by `moemerge build` (token_routed, "
                                          "seq_routed, merged_experts or lora_experts); with "
                                          "--lora, also a dense model.", show_default=False)],
    output: Annotated[Path, typer.Argument(help="Where the dense model (with --lora: the "
                                           "adapter) goes.", show_default=False)],
    expert: Annotated[str | None, typer.Option(
        "--expert", help="The expert to extract: its name as the recipe gives it (or the "
        "name of its directory), or its index from 0. A wrong name lists the valid ones.",
        show_default=False)] = None,
    weights: Annotated[str | None, typer.Option(
        "--weights", help="merged_experts only, instead of --expert: routing scores "
        "w1,w2,... (one per expert, normalised to sum 1); every FFN is merged at them, "
        "W = E_m + α Σ s_i Δ_i.", show_default=False)] = None,
    lora: Annotated[str | None, typer.Option(
        "--lora", metavar="RANK|auto|stored", help="Extract a PEFT LoRA adapter instead "
        "(needs --base): each attention / FFN linear that differs from the base's as the "
        "truncated SVD of its task vector at this rank (at most the matrix's smaller side), or "
        "`auto`: per module, the smallest rank keeping --lora-share of the task vector's "
        "energy. Other modules that differ (embedding, head, norms, a changed bias) are kept "
        "whole in modules_to_save; equal ones are left out. `stored`: an MoE of LoRA experts' "
        "expert as the adapter it stores, exactly (no SVD; --base optional, it only names the "
        "base in adapter_config.json).", show_default=False)] = None,
    lora_share: Annotated[float | None, typer.Option(
        "--lora-share", help="With --lora auto: the share of each module's task-vector "
        "energy (squared Frobenius norm: Σ s_i² of the kept singular values over that of all) "
        "the rank keeps, in (0, 1]; default 0.9.", show_default=False)] = None,
    base: Annotated[str | None, typer.Option(
        "--base", help="With --lora: the dense model the adapter is for (a directory or a hub "
        "id; named in adapter_config.json as base_model_name_or_path). For an MoE's expert, "
        "the base its experts were fine-tuned from (the recipe's base_model).",
        show_default=False)] = None,
    device: Annotated[str, typer.Option(
        "--device", help="With --lora: where the SVDs run (cpu, cuda, cuda:N).")] = "cpu",
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
) -> None:
    """Write one expert of an MoE as a dense model of the family it was built from, which
    transformers loads with no remote code.

    token_routed: the MoE's shared attention, norms, embedding and head with that expert's FFN
    in every layer (what the MoE computes when every token goes to that expert alone).
    seq_routed: that expert's whole decoder stack, with the embedding and head it was routed
    with (its own, or the shared ones). merged_experts: every FFN merged at the scores of that
    expert alone (one-hot) or at --weights. lora_experts: the base with that expert's adapter
    merged (or, with --lora stored, the adapter itself). The tokenizer files are copied and a
    README.md says where the model came from.

    With --lora RANK --base BASE: MODEL (a dense model, or the expert --expert names) as a
    PEFT LoRA adapter on BASE, mergekit-extract-lora's job: adapter_config.json,
    adapter_model.safetensors, and a report of the share of each module's task vector the
    rank keeps (printed, in lora_report.json and README.md)."""
    from moemerge.io.atomic import sweep_output
    from moemerge.io.outputs import check_output, local_inputs

    stored = lora is not None and lora.strip().lower() == "stored"
    rank = lora_rank(lora, lora_share, base, device) if not stored else None
    sweep_output(output)  # what a killed extract left, even if this one fails
    inputs = [("the input model", model), *local_inputs("the base model", [base] if base else [])]
    check_output(output, inputs, force=force, directory=True)
    if stored:  # an MoE of LoRA experts' own adapter, as it stores it
        from moemerge.built.extract import extract_stored_adapter

        done = extract_stored_adapter(model, output, expert=expert, base=base, force=force)
        out.print(f"[green]extracted[/] {escape(done.label)}'s LoRA adapter to "
                  f"{escape(str(output))}: {done.tensors} factors, "
                  f"{done.bytes / 2**20:.1f} MiB", highlight=False)
        return
    if lora is not None:
        _extract_lora(model, output, base, rank, lora_share, expert, weights, device, force)
        return
    from moemerge.built.extract import extract_expert  # torch: after the checks that need none
    done = extract_expert(model, output, expert=expert, weights=weights, force=force)
    out.print(f"[green]extracted[/] {done.label} ({done.kind}) to {output}: {done.tensors} "
              f"tensors, {done.bytes / 2**20:.1f} MiB")


def lora_rank(lora: str | None, share: float | None, base: str | None, device: str
              ) -> int | None:
    """--lora as a rank (None: auto), after the checks of the options that go with it."""
    if lora is None:
        if base is not None or share is not None or device != "cpu":
            raise RecipeError("--base, --lora-share and --device go with --lora RANK|auto")
        return None
    if base is None:
        raise RecipeError("--lora: give --base BASE, the dense model the adapter goes on (for "
                          "an MoE's expert, the base its experts were fine-tuned from)")
    if lora.strip().lower() == "auto":
        if share is not None and not 0 < share <= 1:
            raise RecipeError(f"--lora-share {share:g}: give a share in (0, 1], e.g. 0.9")
        return None
    if share is not None:
        raise RecipeError("--lora-share goes with --lora auto; --lora RANK fixes the rank")
    if not lora.strip().isdigit() or int(lora) < 1:
        raise RecipeError(f"--lora {lora!r}: give a rank (a whole number from 1) or `auto`")
    return int(lora)


def _extract_lora(model: Path, output: Path, base: str, rank: int | None, share: float | None,
                  expert: str | None, weights: str | None, device: str, force: bool) -> None:
    from moemerge.built.extract.lora import extract_lora
    from moemerge.built.extract.lora_files import summary, terminal_table
    from moemerge.execute import check_device  # torch: after the checks that need none
    from moemerge.terminal_tables import Fitted

    if check_device(device).type == "meta":
        raise RecipeError("--device meta: an SVD needs values; use cpu or cuda")
    done = extract_lora(model, output, base=base, rank=rank, share=0.9 if share is None else share,
                        expert=expert, weights=weights, device=device, force=force,
                        progress=True)
    columns, rows = terminal_table(done)
    out.print(Fitted(columns, [[escape(c) for c in row] for row in rows],
                     title=f"LoRA adapter: {escape(done.label)} ({done.kind}) on "
                     f"{escape(base)}", caption="kept: the share of the module's task-vector "
                     "energy its rank keeps; `model.` left out of the names"))
    out.print(f"[green]extracted[/] {escape(done.label)} as a LoRA adapter to "
              f"{escape(str(output))}: {summary(done)}", highlight=False)
