"""`moemerge extend`: new experts joined to an MoE without rebuilding it (docs/extend.md): a
calibrated token-routed MoE that `moemerge build` made (below), a seq_routed / merged_experts
one (built/extend/seq_routed.py, merged.py: the new stack or FFN weights join, each router is
a rebuild's: its random draw, or calibrated again on all the text), or a token-routed MoE it
did not build (a hub Mixtral, Qwen-MoE, ...: `_extend_foreign`, its routers' rows kept and a
row per new expert fitted on calibration text, routing/new_rows.py).

The MoE's tensors are copied with the new experts' FFNs added in every layer. The routers are
refitted from the ridge statistics the build kept (routing/statistics.py) plus the new
experts' calibration text, the only text that runs through the model (fast: layer 0 exact,
deeper layers fitted on the old model's hidden states for the old text), or, with
`recalibrate`, calibrated again on all the text exactly as `build` does (a rebuild's routers);
a build that kept no statistics is calibrated again so, with a note saying so.

Where the recipe's merge of the shared (non-FFN) tensors reads every expert, they are merged
again with the new experts by build's planner and executor (built/extend/remerge.py) unless
`keep_shared`; every hidden state then changes, so calibrated routers are calibrated again on
all the text. Each new expert is checked against the MoE's shapes and the recipe copy's base
where it is at hand (built/extend/same_base.py) before --calibration or --recalibrate is asked
for: an expert of another base is the first thing to hear of. The output is written under the
output rule (atomic, --force) with a recipe copy that rebuilds it from scratch, in the MoE's
own on-disk form (a fused MoE is written fused).
"""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from moemerge.analysis.routing import expert_labels
from moemerge.architectures.forms import layout_of, moe_names
from moemerge.architectures.tables import MoELayout
from moemerge.built.extend import merged, seq_routed
from moemerge.built.extend.recipe import (
    REBUILD,
    NewExpert,
    built_recipe,
    depends_on_experts,
    extended_recipe_text,
    loss_targets_error,
    new_experts,
    recipe_copy,
    with_texts,
)
from moemerge.built.extend.remerge import Remerge, plan_remerge
from moemerge.built.extend.same_base import check_same_base, local_base
from moemerge.built.extend.tensors import check_expert, extended_tensors
from moemerge.errors import CheckpointError, RecipeError
from moemerge.eval.perplexity import load_tokenizer
from moemerge.finish.gguf import too_many_experts
from moemerge.finish.remote_code import copy_modeling_code
from moemerge.finish.verify import FULL_LOAD_LIMIT, check_loads
from moemerge.io.atomic import RECIPE_COPY, SIDE_FILES, atomic_output_dir, copy_side_files
from moemerge.io.paths import check_output_apart
from moemerge.io.reader import CheckpointReader, read_config
from moemerge.io.tensor_list import written_in
from moemerge.io.writer import ShardedWriter, finite, overwrite_tensors, parse_size
from moemerge.loading import check_seq_len, check_tokenizer_fits, vocab_rows
from moemerge.plan.sources import SourceModel, open_sources, resolve_ref
from moemerge.recipe.base import CalibrationText, ModelRef
from moemerge.recipe.kinds import Kind, labelled_refs
from moemerge.routing.calibrate import Calibration, calibrate_token_routers
from moemerge.routing.calibration import (
    calibrates,
    calibration_set,
    calibration_texts,
    calibration_windows,
    model_as_stored,
)
from moemerge.routing.new_rows import grown_routers
from moemerge.routing.refit import refit_token_routers
from moemerge.routing.statistics import (
    STATS_FILE,
    STATS_NOTE,
    LayerStatistics,
    load_statistics,
    save_statistics,
)
from moemerge.train.export import TRAINING_DIR
from moemerge.words import plural

__all__ = ["Extended", "extend_moe"]

OWN_TEXT = "moe"  # --calibration moe=PATH: the text an MoE moemerge did not build keeps


@dataclass
class Extended:
    experts: list[str]  # every expert's name, the new ones last
    tensors: int
    bytes: int
    remerged: str = ""  # what was merged again with the new experts ("" for none)
    recalibrated: bool = False  # the routers calibrated again on all the text
    notes: list[str] = field(default_factory=list)  # what the user should know of the output


def extend_moe(moe: Path, out: Path, experts: list[Path], *, names: list[str] | None = None,
               calibration: list[str] | None = None, keep_shared: bool = False,
               recalibrate: bool = False, force: bool = False, verify: bool = True
               ) -> Extended:
    """Write `moe` grown by `experts` (dense models fine-tuned from its base) to `out`.
    recalibrate: calibrate the routers on all the text, the recipe copy's and the new
    experts' (a rebuild's routers); else refit them from the stored statistics plus the new
    text. keep_shared: keep the shared tensors as built where the merge reads every expert
    (the new experts get weight 0 in the recipe copy); else they are merged again with the new
    experts, which implies recalibrate."""
    moe, out = Path(moe), Path(out)
    config = read_config(moe)
    grow = Kind.of_config(config).command("extend", moe)  # its kind's, recipe/kinds.py
    return grow(moe, out, experts, config, names=names, calibration=calibration,
                keep_shared=keep_shared, recalibrate=recalibrate, force=force, verify=verify)


def extend_token_routed(moe: Path, out: Path, experts: list[Path], config: dict, *,
                        names: list[str] | None, calibration: list[str] | None,
                        keep_shared: bool, recalibrate: bool, force: bool,
                        verify: bool) -> Extended:
    """A token-routed MoE: one moemerge built (its recipe copy and router statistics), or one of
    a layout it reads that it did not build (`_extend_foreign`)."""
    layout = layout_of(config)
    if layout is None:
        raise CheckpointError(f"{moe}: model_type {config.get('model_type')!r}: extend grows a "
                              f"token-routed MoE of a layout moemerge writes "
                              f"({moe_names(built=True)})")
    if not (moe / RECIPE_COPY).is_file():
        return _extend_foreign(moe, out, experts, config, layout, names=names,
                               calibration=calibration, recalibrate=recalibrate, force=force,
                               verify=verify)
    _refuse_trained(moe)
    data, recipe = built_recipe(moe)
    changing = depends_on_experts(recipe)
    remerging = bool(changing) and not keep_shared
    # built before the statistics were kept: the routers are calibrated again on all the text
    unstored = not (recalibrate or remerging) and not (moe / STATS_FILE).is_file()
    calibrating = recalibrate or remerging or unstored  # a re-merge changes every hidden state
    stored, windows = (None, 0) if calibrating else _stored_statistics(
        moe, config, layout.experts_key(config))
    old = expert_labels(moe, layout.expert_count(config))
    new = new_experts(experts, names, old)
    labels = [SimpleNamespace(label=name) for name in [*old, *(e.name for e in new)]]
    grown = dict(config, **{layout.experts_key(config): len(labels)})
    with CheckpointReader(moe) as reader, ExitStack() as stack:
        readers = [stack.enter_context(CheckpointReader(e.path)) for e in new]
        for e, r in zip(new, readers, strict=True):
            check_expert(reader, layout, config, r, f"--expert {e.path}")
        checked = _check_same_base(local_base(recipe, moe, stack), out, new, readers)
        new = with_texts(new, calibration)  # asked for once the experts are known to fit
        recipe_text = extended_recipe_text(data, new, keep_shared) + STATS_NOTE
        remerge = _shared_inputs(data, new, moe, out, remerging, stack)
        if remerge is not None and not checked:  # a base the re-merge found, not a local one
            _check_same_base(remerge.base, out, new, readers)
        cal = _calibration(moe, recipe, new, labels, old_text=calibrating, remerge=remerge,
                           unstored=unstored)
        tensors = extended_tensors(reader, layout, config, readers)
        if remerge is not None:
            tensors = remerge.replace(tensors)
        tensors = written_in(reader.form, layout, tensors)  # a fused MoE stays fused
        size = sum(t.dtype.itemsize * math.prod(t.shape) for t in tensors)
        with atomic_output_dir(out, force=force, size=size) as tmp:
            _write(tmp, moe, tensors, grown, recipe.output.max_shard_size, recipe_text,
                   _card(moe, old, new, calibrating, remerged=remerging))
            routers, stats = _fit_routers(model_as_stored(tmp), cal, stored, windows)
            overwrite_tensors(tmp, {layout.router_name(layer): router
                                    for layer, router in routers.items()})
            save_statistics(tmp / STATS_FILE, stats, windows + cal.ids.shape[0])
            if verify and size <= FULL_LOAD_LIMIT:
                check_loads(tmp)
    notes = [f"{moe} has no {STATS_FILE} (built before moemerge kept router statistics): "
             "the routers were calibrated again on all the calibration text, the recipe "
             "copy's and the new experts', as --recalibrate does"] if unstored else []
    return Extended([label.label for label in labels], len(tensors), size,
                    _remerged(changing, remerge), calibrating,
                    notes + ([note] if (note := too_many_experts(grown)) else []))


def _extend_foreign(moe: Path, out: Path, experts: list[Path], config: dict, layout: MoELayout,
                    *, names: list[str] | None, calibration: list[str] | None,
                    recalibrate: bool, force: bool, verify: bool) -> Extended:
    """A token-routed MoE moemerge did not build (no recipe copy): no base, no calibration
    text and no router statistics are known. Its tensors are kept (the shared ones as they
    are: nothing is merged again), the new experts' FFNs join, and each router keeps its
    rows, gaining one per new expert fitted on calibration text: each new expert's own and
    the text the MoE's own experts keep (`--calibration moe=PATH`), routing/new_rows.py."""
    if not layout.builds:
        raise CheckpointError(
            f"{moe}: {layout.architecture}: extend adds a dense model's FFN as an expert, and "
            f"no dense model family has {layout.name}'s attention and norms (no dense model is "
            f"fine-tuned from its base); extend grows {moe_names(built=True)} MoEs")
    if recalibrate:
        raise RecipeError(f"--recalibrate: {moe} has no {RECIPE_COPY} (not built by moemerge), "
                          "so there is no calibration text of its own to calibrate again on: "
                          "its routers' rows are kept and the new experts' rows fitted on "
                          "--calibration; leave --recalibrate out")
    count = layout.expert_count(config)
    old = expert_labels(moe, count)
    new = new_experts(experts, names, old)
    if any(e.name == OWN_TEXT for e in new):
        raise RecipeError(f"--name {OWN_TEXT}: the name of the MoE's own calibration text "
                          f"(--calibration {OWN_TEXT}=PATH); give the expert another --name")
    labels = [*old, *(e.name for e in new)]
    grown = dict(config, **{layout.experts_key(config): len(labels)})
    with CheckpointReader(moe) as reader, ExitStack() as stack:
        readers = [stack.enter_context(CheckpointReader(e.path)) for e in new]
        for e, r in zip(new, readers, strict=True):
            check_expert(reader, layout, config, r, f"--expert {e.path}")
        own, given = _own_text(moe, calibration)
        new = with_texts(new, given)
        ids, domain, domains = _foreign_windows(moe, config, new, own)
        routers = {layer: reader.read(name) for layer in range(config["num_hidden_layers"])
                   if (name := layout.router_name(layer)) in reader}
        tensors = written_in(reader.form, layout,
                             extended_tensors(reader, layout, config, readers))
        size = sum(t.dtype.itemsize * math.prod(t.shape) for t in tensors)
        with atomic_output_dir(out, force=force, size=size) as tmp:
            _write(tmp, moe, tensors, grown, "5GB", None, _foreign_card(moe, count, new))
            fitted = grown_routers(model_as_stored(tmp), ids, domain,
                                   [domains.index(e.name) for e in new], routers,
                                   int(config["num_experts_per_tok"]))
            overwrite_tensors(tmp, {layout.router_name(layer): router
                                    for layer, router in fitted.items()})
            if verify and size <= FULL_LOAD_LIMIT:
                check_loads(tmp)
    fitted_note = (f"{moe} has no stored router statistics (not built by moemerge): its "
                   f"{plural(len(routers), 'router')} kept their {plural(count, 'row')} and "
                   "gained a row per new expert, fitted on the calibration text (each new "
                   f"expert's own and {OWN_TEXT}=)")
    return Extended(labels, len(tensors), size, "", True,
                    [fitted_note] + ([note] if (note := too_many_experts(grown)) else []))


def _own_text(moe: Path, calibration: list[str] | None) -> tuple[str, list[str]]:
    """(the MoE's own text, `moe=PATH`, as an absolute path; the other --calibration texts)."""
    given = list(calibration or [])
    own = [t for t in given if t.partition("=")[0] == OWN_TEXT]
    if len(own) != 1:
        raise RecipeError(
            f"--calibration {OWN_TEXT}=PATH: {moe} was not built by moemerge, so it has no "
            "calibration text or router statistics of its own; its routers keep their rows and "
            "each new expert's row is fitted to come first on that expert's text and not be "
            f"chosen on the text the MoE's experts keep: give that once, as {OWN_TEXT}=PATH "
            "(any text the MoE should go on routing as before), with each new expert's "
            "NAME=PATH")
    path = Path(own[0].partition("=")[2])
    if not path.exists():
        raise RecipeError(f"--calibration {own[0]}: no such file or directory")
    return str(path.resolve()), [t for t in given if t not in own]


def _foreign_windows(moe: Path, config: dict, new: list[NewExpert], own: str
                     ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(windows [W, S+1], each window's text [W], the texts' names) of the new experts' texts
    and the MoE's own, cut as a build's calibration cuts them (its default seq_len and
    max_tokens), tokenized with the MoE's tokenizer."""
    spec = CalibrationText(data=[*(f"{e.name}={e.text}" for e in new), f"{OWN_TEXT}={own}"])
    texts = calibration_texts(spec, moe)
    check_seq_len(spec.seq_len, "calibration windows", config, moe)
    tokenizer = load_tokenizer(moe)
    check_tokenizer_fits(tokenizer, vocab_rows(config), moe, moe)
    return calibration_windows(spec, texts, tokenizer)


def _foreign_card(moe: Path, count: int, new: list[NewExpert]) -> str:
    return (f"# `{moe.name}` extended by {', '.join(e.name for e in new)}\n\n"
            f"Written by `moemerge extend` from the MoE `{moe}` ({plural(count, 'expert')}; not "
            "built by moemerge): its tensors as they were, the new experts' FFNs added in every "
            "layer as experts "
            f"{', '.join(str(count + k) for k in range(len(new)))}. Every router keeps its rows "
            "for the old experts and gained one per new expert, fitted in closed form on the "
            "calibration text: first on the new expert's own text, not chosen on the MoE's "
            "(docs/extend.md).\n")


def _shared_inputs(data: dict, new: list[NewExpert], moe: Path, out: Path, remerging: bool,
                   stack: ExitStack) -> Remerge | None:
    """With a re-merge, the recipe copy's models opened and planned (built/extend/remerge.py),
    OUT checked apart from each of them (the output rule); else None."""
    if not remerging:
        return None
    remerge = plan_remerge(data, new, moe, stack)
    check_output_apart(out, [(f"input model {m.label}", m.path) for m in remerge.models])
    return remerge


def _check_same_base(base: SourceModel | None, out: Path, new: list[NewExpert],
                     readers: list[CheckpointReader]) -> bool:
    """Each new expert against the recipe copy's base where it is at hand (else no check: the
    return is False); OUT apart from that base (the output rule). Run before anything asks for
    --calibration or --recalibrate: an expert of another base is the problem to name first."""
    if base is None:
        return False
    check_output_apart(out, [("the base", base.path)])
    for e, r in zip(new, readers, strict=True):
        check_same_base(base, r, f"--expert {e.path}")
    return True


def _remerged(changing: list[str], remerge: Remerge | None) -> str:
    """What the re-merge did, for the CLI's note ("" without one)."""
    if remerge is None:
        return ""
    return (f"the shared tensors depend on the expert set ({', '.join(changing)}): "
            f"{len(remerge.jobs)} re-merged with the new experts, as `moemerge build` of the "
            "recipe copy merges them (--keep-shared keeps them as built)")


def _refuse_trained(moe: Path) -> None:
    if (moe / TRAINING_DIR).exists():
        raise CheckpointError(f"{moe}: trained by `moemerge finetune` after the build "
                              f"({TRAINING_DIR}/): extend makes the build's routers and "
                              "curvature for the grown expert set, which would drop the "
                              "training; extend the model `build` wrote, then train again")


def _extend_assembly(assembly: ModuleType, moe: Path, out: Path, experts: list[Path],
                     config: dict, *, names: list[str] | None, calibration: list[str] | None,
                     keep_shared: bool, recalibrate: bool, force: bool,
                     verify: bool) -> Extended:
    """seq_routed and merged_experts, grown by `assembly` (built/extend/seq_routed.py or
    merged.py): build keeps no router statistics for them, so a calibrated router is calibrated
    again on all the text (--recalibrate); every other router is the random draw a rebuild
    makes."""
    kind = Kind.of_config(config).name  # for messages
    data, recipe = recipe_copy(moe, "add the experts to its recipe and build it")
    recipe = assembly.check_recipe(recipe, config, moe)
    _refuse_trained(moe)
    changing = assembly.changing(recipe)
    remerging = bool(changing) and not keep_shared
    calibrated = calibrates(recipe)
    old = list(config["expert_names"])
    new = new_experts(experts, names, old)
    labels = [SimpleNamespace(label=name) for name in [*old, *(e.name for e in new)]]
    with CheckpointReader(moe) as reader, ExitStack() as stack:
        sources = open_sources([(e.name, ModelRef(model=str(e.path))) for e in new], None,
                               allow_pickle=False, stack=stack, compatible=False)
        jobs = []
        for k, (e, source) in enumerate(zip(new, sources, strict=True)):
            index = len(old) + k
            made = assembly.new_expert_jobs(recipe, config, k, source, index)
            assembly.check_expert(reader, config, source, made, index, f"--expert {e.path}")
            jobs += made
        readers = [s.reader for s in sources]
        checked = _check_same_base(local_base(recipe, moe, stack), out, new, readers)
        if calibrated and not (recalibrate or remerging):
            raise CheckpointError(f"{moe}: its router was calibrated, and `build` keeps no "
                                  f"router statistics for {kind} models: "
                                  "pass --recalibrate (all the calibration text of the recipe "
                                  "copy, which must still exist, and the new experts' texts, "
                                  "calibrated again as build does)")
        new = with_texts(new, calibration, need_text=calibrated)
        remerge = _shared_inputs(data, new, moe, out, remerging, stack)
        if remerge is not None and not checked:  # a base the re-merge found, not a local one
            _check_same_base(remerge.base, out, new, readers)
        cal = (_calibration(moe, recipe, new, labels, old_text=True, remerge=remerge)
               if calibrated else None)
        grown = assembly.grown_config(config, sources, [e.name for e in new])
        tensors = assembly.extended_tensors(reader, config, recipe, sources, jobs)
        if remerge is not None:
            tensors = remerge.replace(tensors)
        size = sum(t.dtype.itemsize * math.prod(t.shape) for t in tensors)
        with atomic_output_dir(out, force=force, size=size) as tmp:
            _write(tmp, moe, tensors, grown, recipe.output.max_shard_size,
                   extended_recipe_text(data, new, keep_shared),
                   _card(moe, old, new, calibrated, kind,
                         remerged=remerging))
            copy_modeling_code(tmp)
            if cal is not None:  # build's calibration, on the grown model
                overwrite_tensors(tmp, assembly.calibrated_routers(model_as_stored(tmp), cal))
            if verify and size <= FULL_LOAD_LIMIT:
                check_loads(tmp)
    return Extended([label.label for label in labels], len(tensors), size,
                    _remerged(changing, remerge), calibrated)


# the kinds table's extend targets for them
extend_seq_routed = partial(_extend_assembly, seq_routed)
extend_merged_experts = partial(_extend_assembly, merged)


def _write(tmp: Path, moe: Path, tensors: list, config: dict, shard_size: str,
           recipe_text: str | None, card: str) -> None:
    planned = [(t.name, t.dtype, t.shape) for t in tensors]
    with ShardedWriter(tmp, planned, max_shard_bytes=parse_size(shard_size)) as writer:
        for t in tensors:
            writer.write(t.name, finite(t.name, t.make().to(t.dtype).contiguous(),
                                        f"from {moe}, the new experts or their re-merge"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(moe, tmp, SIDE_FILES)
    if recipe_text is not None:  # (an MoE moemerge did not build: none to rebuild it)
        (tmp / RECIPE_COPY).write_text(recipe_text)
    (tmp / "README.md").write_text(card)


def _calibration(moe: Path, recipe, new: list[NewExpert], labels: list, *, old_text: bool,
                 remerge: Remerge | None = None, unstored: bool = False) -> Calibration:
    """The windows the routers are fitted on: the new experts' texts, after (old_text) the
    recipe copy's, read as `moemerge build MOE/moemerge_recipe.yaml` reads them (a relative
    path next to MOE, else in the working directory): the windows and targets a rebuild has.
    Tokenized with the tokenizer build reads (_build_tokenizer)."""
    remerging, spec = remerge is not None, recipe.calibration
    texts = calibration_texts(spec.model_copy(update={
        "data": [f"{e.name}={e.text}" for e in new]}), moe)
    if old_text:
        try:
            texts = calibration_texts(spec, moe) | texts
        except RecipeError as exc:
            if remerging:
                raise RecipeError(
                    f"{moe / RECIPE_COPY}: {exc}: the shared tensors are merged again with "
                    "the new experts, which changes every hidden state, so the routers are "
                    "calibrated again on all the calibration text; restore it there, or pass "
                    "--keep-shared (the shared tensors stay as built)") from None
            if unstored:
                raise RecipeError(
                    f"{moe / RECIPE_COPY}: {exc}: {moe} has no {STATS_FILE} (built before "
                    "moemerge kept router statistics), so the routers are calibrated again "
                    f"on all the calibration text; restore it there, or {REBUILD}") from None
            raise RecipeError(f"{moe / RECIPE_COPY}: {exc}: --recalibrate reads the build's "
                              "calibration text again; restore it there, or extend without "
                              "--recalibrate (refit from the stored statistics)") from None
    config = read_config(moe)  # the extended MoE's: its embedding and positions are MOE's
    check_seq_len(spec.seq_len, f"{moe / RECIPE_COPY}: calibration.seq_len", config, moe)
    where = _build_tokenizer(moe, recipe, remerge)
    tokenizer = load_tokenizer(where)
    check_tokenizer_fits(tokenizer, vocab_rows(config), where, moe)  # before any forward pass
    return calibration_set(spec, texts, tokenizer, labels)


def _build_tokenizer(moe: Path, recipe, remerge: Remerge | None) -> Path:
    """Where the tokenizer that `build` of the recipe copy reads is: its first model's
    directory (the base of a token_routed MoE) where it is at hand, else MOE's copy of it.
    They differ in class where config.json names another family (a Qwen2 base's loads as
    Qwen2Tokenizer, MOE's copy under qwen2_moe as another, with other windows)."""
    if remerge is not None:
        return remerge.models[0].path
    try:
        return resolve_ref(labelled_refs(recipe)[0][1], moe, hub=False)
    except CheckpointError:
        return moe


def _fit_routers(model, cal: Calibration, stored: dict[int, LayerStatistics] | None,
                 windows: int) -> tuple[dict[int, torch.Tensor], dict[int, LayerStatistics]]:
    """({layer: router}, {layer: its statistics}): the build's own calibration when nothing is
    stored (cal holds all the text), else the refit of the stored statistics plus cal's."""
    if stored is None:
        stats: dict[int, LayerStatistics] = {}
        return calibrate_token_routers(model, cal, stats), stats
    return refit_token_routers(model, cal, stored, windows)


def _stored_statistics(moe: Path, config: dict, count_key: str):
    file = moe / STATS_FILE
    if not file.is_file():
        raise CheckpointError(f"{moe}: no {STATS_FILE}: built without the router statistics "
                              f"extend refits from (before moemerge kept them, or with another "
                              f"router init): pass --recalibrate (all the calibration text "
                              f"again, no statistics needed), or {REBUILD}")
    try:
        stored, windows = load_statistics(file)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{file}: unreadable router statistics ({exc}); {REBUILD}"
                              ) from None
    experts, layers = int(config[count_key]), int(config["num_hidden_layers"])
    if sorted(stored) != list(range(layers)) or any(s.experts != experts
                                                    for s in stored.values()):
        raise CheckpointError(f"{file}: statistics for {plural(len(stored), 'layer')} and "
                              f"{plural(stored[0].experts if stored else 0, 'expert')}, the "
                              f"model has {layers} and {experts}; {REBUILD}")
    targets = stored[0].fit.targets
    if bool((targets - targets.diag().diag()).abs().max() > 0):  # YᵀY of one-hot is diagonal
        raise loss_targets_error(moe)
    return stored, windows


def _card(moe: Path, old: list[str], new: list[NewExpert], recalibrate: bool,
          kind: str = "token_routed", *, remerged: bool = False) -> str:
    routers = ("calibrated again on all the calibration text, the build's and the new "
               "experts', as a rebuild does" if recalibrate else "refitted from the build's "
               "ridge statistics and the new experts' calibration text")
    if kind != "token_routed" and not recalibrate:
        routers = "the random draw a rebuild makes (not calibrated)"
    what, joined = {
        "token_routed": ("token-routed", "FFNs added in every layer"),
        "seq_routed": ("seq_routed", "whole decoder stacks added as experts"),
        "merged_experts": ("merged_experts", "FFN weights added to every layer's experts "
                                             "(curvature at the identity)"),
    }[kind]
    router = "every router" if kind != "seq_routed" else "the router"
    shared = ("the shared tensors merged again with the new experts as a rebuild merges them, "
              "the same" if remerged else "the same shared tensors")
    return (f"# `{moe.name}` extended by {', '.join(e.name for e in new)}\n\n"
            f"Written by `moemerge extend` from the {what} MoE `{moe}` (experts "
            f"{', '.join(old)}): {shared} and experts, the new experts' {joined}, "
            f"{router} {routers}. `{RECIPE_COPY}` rebuilds it from "
            "scratch with `moemerge build` (docs/extend.md).\n")
