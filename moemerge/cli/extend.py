"""`moemerge extend`: new experts joined to an MoE moemerge built (token_routed, seq_routed,
merged_experts) or a token-routed one it did not build, no rebuild."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moemerge.cli.app import app, out, reports_errors
from moemerge.words import plural


@app.command()
@reports_errors
def extend(
    model: Annotated[Path, typer.Argument(help="An MoE built by `moemerge build` (token_routed "
                                          "with router.init: calibrate, seq_routed or "
                                          "merged_experts), or a Mixtral, Qwen2-MoE, "
                                          "Qwen3-MoE, FlexOlmo or GraniteMoE it did not build.",
                                          show_default=False)],
    output: Annotated[Path, typer.Argument(help="Where the extended MoE goes.",
                                           show_default=False)],
    expert: Annotated[list[Path], typer.Option(
        "--expert", help="A dense model fine-tuned from the MoE's base (repeat for several); "
        "its FFN joins every layer as a new expert (seq_routed: its whole decoder stack; "
        "merged_experts: its FFN weights join every layer's experts).", show_default=False)],
    name: Annotated[list[str] | None, typer.Option(
        "--name", help="The new expert's name, one per --expert in order (default: its "
        "directory's name).", show_default=False)] = None,
    calibration: Annotated[list[str] | None, typer.Option(
        "--calibration", help="The new expert's calibration text, NAME=PATH (or a bare PATH "
        "per --expert in order), in the forms `finetune --data` reads. Without --recalibrate "
        "only this text runs through the model. Only for calibrated routers. For an MoE "
        "moemerge did not build, also the text its own experts keep, moe=PATH.",
        show_default=False)] = None,
    recalibrate: Annotated[bool, typer.Option(
        "--recalibrate", help="Exact: calibrate every router again, layer by layer as `build` "
        "does, on all the calibration text (the recipe copy's, which must still exist, and "
        "the new experts'): the routers a rebuild gets, for the old text's forwards. Without "
        "it, only layer 0's router is a rebuild's; deeper ones are fitted on the old model's "
        "hidden states. Needed for a calibrated seq_routed or merged_experts router (build "
        "keeps no statistics for them). Implied where the shared tensors are merged again "
        "(see --keep-shared).")] = False,
    keep_shared: Annotated[bool, typer.Option(
        "--keep-shared", help="Keep the shared tensors as built (token_routed and "
        "merged_experts: attention, norms, embedding and head; seq_routed: the embedding and "
        "head not kept per expert): the old experts compute as before and the new ones join "
        "the recipe copy with weight 0. Without it, where the recipe's merge reads every "
        "expert (any method but `base`, or shared_expert: average), they are merged again "
        "with the new experts as a rebuild merges them (the base and old experts are read "
        "where the recipe copy names them) and calibrated routers are calibrated again on "
        "all the text.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace OUTPUT if it exists.")] = False,
) -> None:
    """Add experts to an MoE, built by moemerge or not, without rebuilding it.

    The MoE's tensors are copied and each new expert joins as expert E, E+1, ...:
    token_routed, its FFN in every layer; seq_routed, its whole decoder stack (and its own
    embedding and head with per_expert); merged_experts, its FFN weights in every layer's
    expert stack, CAMEx curvature at the identity as build starts it. A token router is
    refitted in closed form from the ridge statistics the build kept
    (router_stats.safetensors, written by `router.init: calibrate`) plus the new experts'
    calibration text: the old calibration text is not read again, and only layer 0's router
    is the one a rebuild gets. With --recalibrate every router is calibrated again on all the
    text, as a rebuild does (exact). An uncalibrated router (random, perplexity, task_vector)
    becomes the one a rebuild writes. Where the recipe's merge of the shared tensors reads
    every expert, they are merged again with the new experts as a rebuild merges them, and
    calibrated routers are calibrated again on all the text (a note says so); --keep-shared
    keeps them as built. A new expert not fine-tuned from the MoE's base is refused. OUTPUT
    gets a recipe copy with the new experts appended, which `moemerge build` rebuilds from
    scratch (docs/extend.md). A calibrated MoE built before the statistics were kept is
    calibrated again on all the text, as with --recalibrate (a note says so).

    An MoE moemerge did not build (a hub Mixtral, in either on-disk form) has no recipe copy
    or statistics: its tensors are kept, the new experts' FFNs join, and each router keeps
    its rows and gains one per new expert, fitted on the new experts' texts and on
    `--calibration moe=PATH`, text the MoE should go on routing as before (a note says so).
    The output keeps the MoE's on-disk form."""
    from moemerge.io.atomic import sweep_output
    from moemerge.io.outputs import check_output, local_inputs

    sweep_output(output)  # what a killed extend left, even if this one fails
    inputs = [("the input model", model), *local_inputs("an --expert model", expert),
              *local_inputs("a --calibration text", calibration or [])]
    check_output(output, inputs, force=force, directory=True)
    from moemerge.built.extend.command import extend_moe  # torch: after the checks that need none
    done = extend_moe(model, output, expert, names=name, calibration=calibration,
                      keep_shared=keep_shared, recalibrate=recalibrate, force=force)
    out.print(f"[green]extended[/] {model} to {output}: experts {', '.join(done.experts)}; "
              f"{plural(done.tensors, 'tensor')}, {done.bytes / 2**20:.1f} MiB")
    for note in done.notes:
        out.print(f"[yellow]note:[/] {note}", highlight=False)
    if done.remerged:  # the default where the merge reads every expert: say what it did
        routers = ("; the routers were calibrated again on all the calibration text"
                   if done.recalibrated else "")
        out.print(f"note: {done.remerged}{routers}", markup=False, highlight=False)
