"""The two on-disk forms of an MoE checkpoint, and the one form the rest of moemerge reads.

- *classic*: each expert's projection its own tensor (`experts.{e}.w1.weight`, ...; GraniteMoE's
  input_linear / output_linear stacks), what transformers' `save_pretrained` writes and
  llama.cpp's converter reads;
- *fused*: transformers 5's in-memory names, gate_up_proj [E, 2I, H] and down_proj [E, H, I] per
  layer (moe.yaml's `fused_form`), which mergekit 0.1.5 writes.

`classic_view` shows a fused checkpoint's tensors under their classic names. Expert e's gate rows
of gate_up_proj are one contiguous byte range of the file, so each classic tensor is a slice of
its stack's bytes: nothing is read twice, and an expert copied unchanged is still copied byte
for byte. The writers go the other way with `written_layout` (plans: the stacks are `fuse` jobs)
and `fused_tensors` (post-build commands writing a list of tensors).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol, TypeVar

from moemerge.architectures.tables import MoELayout, moe_layouts
from moemerge.errors import CheckpointError, MismatchError

CLASSIC, FUSED = "classic", "fused"
FORMS = (CLASSIC, FUSED)


def layout_of(config: dict) -> MoELayout | None:
    """The MoE layout of a config.json (by `model_type`), None for any other model."""
    return next((lay for lay in moe_layouts().values()
                 if lay.model_type == config.get("model_type")), None)


def moe_names(built: bool = False) -> str:
    """The MoE families moemerge reads (`built`: writes), for messages ("Mixtral, Qwen2Moe,
    ...")."""
    return ", ".join(lay.architecture.removesuffix("ForCausalLM")
                     for lay in moe_layouts().values() if lay.builds or not built)


def name_pattern(template: str) -> re.Pattern:
    """A moe.yaml name template as a regex with layer / expert / proj groups."""
    text = re.escape(template)
    for key, group in (("layer", r"(?P<layer>\d+)"), ("expert", r"(?P<expert>\d+)"),
                       ("proj", r"(?P<proj>[^.]+)")):
        text = text.replace(re.escape("{" + key + "}"), group)
    return re.compile(text)


class _Meta(Protocol):  # io.reader.TensorMeta (this layer sits below io)
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def dtype(self) -> Any: ...


M = TypeVar("M", bound=_Meta)


def classic_view(config: dict, metas: dict[str, M], where: str, per_expert: bool = False
                 ) -> tuple[str | None, dict[str, M]]:
    """(the checkpoint's form, its tensors under classic names) for an MoE of a known layout;
    (None, metas) unchanged for any other model. A fused stack becomes one entry per expert and
    projection, each a byte range of the stack; a tensor in neither form is an error naming
    it and the forms this layout has. `per_expert`: the classic form's own stacks too
    (GraniteMoE's input_linear: each expert's gate and up under the layout's `expert` names),
    as merges plan them."""
    layout = layout_of(config)
    if layout is None:
        return None, metas
    form, view = _classic(layout, config, metas, where)
    if per_expert and layout.fused:
        view = _per_expert(layout, config, view, where)
    return form, view


def _per_expert(layout: MoELayout, config: dict, view: dict[str, M], where: str
                ) -> dict[str, M]:
    patterns = {template: name_pattern(template) for template in layout.fused}
    out: dict[str, M] = {}
    for name, meta in view.items():
        template = next((t for t, p in patterns.items() if p.fullmatch(name)), None)
        if template is None:
            out[name] = meta
            continue
        layer = int(patterns[template].fullmatch(name)["layer"])
        out |= _unstack(layout, config, layer, meta, layout.fused[template], where)
    return out


def _classic(layout: MoELayout, config: dict, metas: dict[str, M], where: str
             ) -> tuple[str, dict[str, M]]:
    if not layout.fused_form:
        return CLASSIC, metas
    patterns = {template: name_pattern(template) for template in layout.fused_form}
    view: dict[str, M] = {}
    fused_seen = classic_seen = None
    for name, meta in metas.items():
        template, found = next(((t, m) for t, p in patterns.items() if (m := p.fullmatch(name))),
                               (None, None))
        if template is None:
            view[name] = meta
            if classic_seen is None and _is_classic_expert(layout, name):
                classic_seen = name
            continue
        fused_seen = fused_seen or name
        layer, target = int(found["layer"]), layout.fused_form[template]
        if isinstance(target, str):  # a renamed tensor (a router, GraniteMoE's stacks)
            view[target.format(layer=layer)] = replace(meta, name=target.format(layer=layer))
            continue
        view |= _unstack(layout, config, layer, meta, target, where)
    if fused_seen and classic_seen:
        raise CheckpointError(f"{where}: both forms in one checkpoint: {classic_seen} (classic) "
                              f"and {fused_seen} (fused); moemerge reads one or the other")
    _check_known(layout, view, where)
    return (FUSED if fused_seen else CLASSIC), view


def _is_classic_expert(layout: MoELayout, name: str) -> bool:
    return any(name_pattern(t).fullmatch(name) for t in (layout.expert, *layout.fused))


def _unstack(layout: MoELayout, config: dict, layer: int, meta: M, projs: Sequence[str],
             where: str) -> dict[str, M]:
    """{classic name: its byte range} of each expert's projections in a fused stack
    [E, rows, cols]: expert e's part p is rows p·rows/P … (p+1)·rows/P of its block."""
    name = meta.name
    if meta.offset < 0:
        raise CheckpointError(f"{where}: {name} is a fused expert stack in a pickled file; "
                              "convert the checkpoint to safetensors first")
    key = layout.experts_key(config)
    experts = config.get(key)
    if len(meta.shape) != 3 or meta.shape[0] != experts or meta.shape[1] % len(projs):
        raise CheckpointError(
            f"{where}: {name} has shape {list(meta.shape)}; a fused stack of "
            f"{'+'.join(projs)} is [{key} = {experts}, "
            f"{len(projs)} x rows, cols]")
    _, rows, cols = meta.shape
    step, itemsize = rows // len(projs), meta.dtype.itemsize
    return {(classic := layout.expert_name(layer, e, proj)): replace(
                meta, name=classic, shape=(step, cols),
                offset=meta.offset + (e * rows + p * step) * cols * itemsize)
            for e in range(experts) for p, proj in enumerate(projs)}


def _check_known(layout: MoELayout, view: dict, where: str) -> None:
    """No tensor of an expert block outside the layout's templates: an unknown form (a third
    naming, another fusion) is refused rather than merged or copied as if it were dense."""
    known = [name_pattern(t) for t in (layout.expert, layout.router, *layout.fused,
                                       *layout.fused_shared, layout.shared_expert,
                                       layout.shared_expert_gate, layout.router_bias)
             if t is not None]
    for name in view:
        if ".experts." in name and not any(p.fullmatch(name) for p in known):
            raise MismatchError(
                f"{where}: tensor {name!r} is in no form of {layout.name} that moemerge reads: "
                f"{CLASSIC} ({layout.expert.format(layer=0, expert=0, proj='…')}) or {FUSED} "
                f"({', '.join(t.format(layer=0) for t in layout.fused_form)})")


def written_layout(layout: MoELayout, form: str) -> MoELayout:
    """The layout a plan writes `form` with: for fused, moe.yaml's fused_form names as the
    stacks `fuse_jobs` makes, which then renames what the fused form renames (Mixtral's
    router); classic: the layout itself."""
    if form == CLASSIC:
        return layout
    if not layout.fused_form:
        raise MismatchError(f"output.experts: fused: the {layout.name} layout has no fused form "
                            "(its modeling code reads per-expert tensors); use classic")
    stacks = {name: target for name, target in layout.fused_form.items()
              if not isinstance(target, str)}
    stacks |= {renamed_name(layout, name): projs for name, projs in layout.fused.items()}
    return replace(layout, fused=stacks, form=FUSED)


def renamed_name(layout: MoELayout, classic: str) -> str:
    """The fused form's name of the classic tensor (or template) `classic` (itself when
    the fused form keeps it)."""
    for fused, target in layout.fused_form.items():
        if isinstance(target, str):
            found = name_pattern(target).fullmatch(classic)
            if found:
                return fused.format(layer=found["layer"])
            if target == classic:
                return fused
    return classic


T = TypeVar("T")


def fused_tensors(layout: MoELayout, tensors: list[T], name: Callable[[T], str],
                  stack: Callable[[str, list[list[T]]], T],
                  rename: Callable[[T, str], T]) -> list[T]:
    """A classic-form tensor list in the fused form, in order: each layer's per-expert parts
    become one stack (`stack(fused name, [[expert 0's parts], ...])`, at the first part's
    place), renamed tensors `rename`d; anything else as it is."""
    by_name = {name(t): t for t in tensors}
    replaced: dict[str, T] = {}  # first member's classic name -> the stack that replaces it
    members: set[str] = set()
    layers = sorted({int(m["layer"]) for t in tensors
                     if (m := name_pattern(layout.router).fullmatch(name(t)))})
    for layer in layers:
        for template, projs in layout.fused_form.items():
            if isinstance(projs, str):
                continue
            groups, expert = [], 0
            while (names := [layout.expert_name(layer, expert, p) for p in projs])[0] in by_name:
                groups.append([by_name[n] for n in names])
                expert += 1
            if groups:
                replaced[name(groups[0][0])] = stack(template.format(layer=layer), groups)
                members.update(name(t) for g in groups for t in g)
    out = []
    for t in tensors:
        if name(t) in replaced:
            out.append(replaced[name(t)])
        elif name(t) not in members:
            stored = renamed_name(layout, name(t))
            out.append(t if stored == name(t) else rename(t, stored))
    return out
