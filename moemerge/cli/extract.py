"""`moemerge extract`: one expert of an MoE moemerge built, as a dense model; with --lora, that
expert or any dense model as a PEFT LoRA adapter on a base."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from moemerge.build_options import options_of
from moemerge.built.options import LORA_FORMS, ExtractOptions
from moemerge.cli.app import app, defaults, described, out, reports_errors
from moemerge.errors import RecipeError

D = defaults(ExtractOptions)


def Option(name: str, *decls: str, **extra):  # noqa: N802 - reads as typer's
    """The typer option of ExtractOptions field `name`, described by it."""
    return described(ExtractOptions, name, *decls, **extra)


@app.command()
@reports_errors
def extract(
    model: Annotated[Path, typer.Argument(help="An MoE built by `moemerge build` (token_routed, "
                                          "seq_routed, merged_experts or lora_experts); with "
                                          "--lora, also a dense model.", show_default=False)],
    output: Annotated[Path, typer.Argument(help="Where the dense model (with --lora: the "
                                           "adapter) goes.", show_default=False)],
    expert: Annotated[str | None, Option("expert", show_default=False)] = None,
    weights: Annotated[str | None, Option("weights", show_default=False)] = None,
    lora: Annotated[str | None, Option("lora", metavar=LORA_FORMS, show_default=False)] = None,
    lora_share: Annotated[float | None, Option("lora_share", show_default=False)] = None,
    base: Annotated[str | None, Option("base", show_default=False)] = None,
    device: Annotated[str, Option("device")] = D["device"],
    force: Annotated[bool, Option("force")] = D["force"],
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

    options = options_of(ExtractOptions, expert=expert, weights=weights, lora=lora,
                         lora_share=lora_share, base=base, device=device, force=force)
    sweep_output(output)  # what a killed extract left, even if this one fails
    inputs = [("the input model", model), *local_inputs("the base model", [base] if base else [])]
    check_output(output, inputs, force=force, directory=True)
    if options.stored:  # an MoE of LoRA experts' own adapter, as it stores it
        from moemerge.built.extract import extract_stored_adapter

        done = extract_stored_adapter(model, output, expert=expert, base=base, force=force)
        out.print(f"[green]extracted[/] {escape(done.label)}'s LoRA adapter to "
                  f"{escape(str(output))}: {done.tensors} factors, "
                  f"{done.bytes / 2**20:.1f} MiB", highlight=False)
        return
    if lora is not None:
        _extract_lora(model, output, options)
        return
    from moemerge.built.extract import extract_expert  # torch: after the checks that need none
    done = extract_expert(model, output, expert=expert, weights=weights, force=force)
    out.print(f"[green]extracted[/] {done.label} ({done.kind}) to {output}: {done.tensors} "
              f"tensors, {done.bytes / 2**20:.1f} MiB")


def _extract_lora(model: Path, output: Path, options: ExtractOptions) -> None:
    from moemerge.built.extract.lora import extract_lora
    from moemerge.built.extract.lora_files import summary, terminal_table
    from moemerge.execute import check_device  # torch: after the checks that need none
    from moemerge.terminal_tables import Fitted

    if check_device(options.device).type == "meta":
        raise RecipeError("--device meta: an SVD needs values; use cpu or cuda")
    share = 0.9 if options.lora_share is None else options.lora_share
    done = extract_lora(model, output, base=options.base, rank=options.rank, share=share,
                        expert=options.expert, weights=options.weights, device=options.device,
                        force=options.force, progress=True)
    columns, rows = terminal_table(done)
    out.print(Fitted(columns, [[escape(c) for c in row] for row in rows],
                     title=f"LoRA adapter: {escape(done.label)} ({done.kind}) on "
                     f"{escape(options.base)}", caption="kept: the share of the module's "
                     "task-vector energy its rank keeps; `model.` left out of the names"))
    out.print(f"[green]extracted[/] {escape(done.label)} as a LoRA adapter to "
              f"{escape(str(output))}: {summary(done)}", highlight=False)
