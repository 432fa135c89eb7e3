"""`moemerge extend`: new experts joined to an MoE moemerge built (token_routed, seq_routed,
merged_experts) or a token-routed one it did not build, no rebuild."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from moemerge.architectures.forms import moe_names
from moemerge.build_options import options_of
from moemerge.built.options import ExtendOptions
from moemerge.cli.app import app, defaults, described, out, reports_errors
from moemerge.words import plural

D = defaults(ExtendOptions)


def Option(name: str, *decls: str, **extra):  # noqa: N802 - reads as typer's
    """The typer option of ExtendOptions field `name`, described by it."""
    return described(ExtendOptions, name, *decls, **extra)


@app.command()
@reports_errors
def extend(
    model: Annotated[Path, typer.Argument(help="An MoE built by `moemerge build` (token_routed "
                                          "with router.init: calibrate, seq_routed or "
                                          "merged_experts), or one of a layout moemerge "
                                          "writes that it did not build "
                                          f"({moe_names(built=True)}).", show_default=False)],
    output: Annotated[Path, typer.Argument(help="Where the extended MoE goes.",
                                           show_default=False)],
    expert: Annotated[list[Path], Option("expert", "--expert", show_default=False)],
    name: Annotated[list[str] | None, Option("name", "--name", show_default=False)] = None,
    calibration: Annotated[list[str] | None, Option("calibration", "--calibration",
                                                    show_default=False)] = None,
    recalibrate: Annotated[bool, Option("recalibrate", "--recalibrate")] = D["recalibrate"],
    keep_shared: Annotated[bool, Option("keep_shared", "--keep-shared")] = D["keep_shared"],
    force: Annotated[bool, Option("force", "--force")] = D["force"],
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

    options = options_of(ExtendOptions, expert=expert, name=name, calibration=calibration,
                         recalibrate=recalibrate, keep_shared=keep_shared, force=force)
    sweep_output(output)  # what a killed extend left, even if this one fails
    inputs = [("the input model", model), *local_inputs("an --expert model", expert),
              *local_inputs("a --calibration text", calibration or [])]
    check_output(output, inputs, force=force, directory=True)
    from moemerge.built.extend.command import extend_moe  # torch: after the checks that need none
    done = extend_moe(model, output, options.expert, names=options.name,
                      calibration=options.calibration, keep_shared=options.keep_shared,
                      recalibrate=options.recalibrate, force=options.force)
    out.print(f"[green]extended[/] {model} to {output}: experts {', '.join(done.experts)}; "
              f"{plural(done.tensors, 'tensor')}, {done.bytes / 2**20:.1f} MiB")
    for note in done.notes:
        out.print(f"[yellow]note:[/] {note}", highlight=False)
    if done.remerged:  # the default where the merge reads every expert: say what it did
        routers = ("; the routers were calibrated again on all the calibration text"
                   if done.recalibrated else "")
        out.print(f"note: {done.remerged}{routers}", markup=False, highlight=False)
