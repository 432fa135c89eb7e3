"""`moemerge extract`: one expert of an MoE moemerge built, as a dense model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moemerge.cli.app import app, out, reports_errors


@app.command()
@reports_errors
def extract(
    model: Annotated[Path, typer.Argument(help="An MoE built by `moemerge build` (token_routed, "
                                          "seq_routed or merged_experts).",
                                          show_default=False)],
    output: Annotated[Path, typer.Argument(help="Where the dense model goes.",
                                           show_default=False)],
    expert: Annotated[str | None, typer.Option(
        "--expert", help="The expert to extract: its name as the recipe gives it (or the "
        "name of its directory), or its index from 0. A wrong name lists the valid ones.",
        show_default=False)] = None,
    weights: Annotated[str | None, typer.Option(
        "--weights", help="merged_experts only, instead of --expert: routing scores "
        "w1,w2,... (one per expert, normalised to sum 1); every FFN is merged at them, "
        "W = E_m + α Σ s_i Δ_i.", show_default=False)] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
) -> None:
    """Write one expert of an MoE as a dense model of the family it was built from, which
    transformers loads with no remote code.

    token_routed: the MoE's shared attention, norms, embedding and head with that expert's FFN
    in every layer (what the MoE computes when every token goes to that expert alone).
    seq_routed: that expert's whole decoder stack, with the embedding and head it was routed
    with (its own, or the shared ones). merged_experts: every FFN merged at the scores of that
    expert alone (one-hot) or at --weights. The tokenizer files are copied and a README.md
    says where the model came from."""
    from moemerge.io.atomic import sweep_output
    from moemerge.io.outputs import check_output

    sweep_output(output)  # what a killed extract left, even if this one fails
    check_output(output, [("the input model", model)], force=force, directory=True)
    from moemerge.finish.extract import extract_expert  # torch: after the checks that need none
    done = extract_expert(model, output, expert=expert, weights=weights, force=force)
    out.print(f"[green]extracted[/] {done.label} ({done.kind}) to {output}: {done.tensors} "
              f"tensors, {done.bytes / 2**20:.1f} MiB")
