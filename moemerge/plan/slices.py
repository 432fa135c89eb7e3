"""Dense merges given as `slices`: the output's layers are a stack of slices, each merged from
the same number of consecutive layers of its sources (mergekit's slices; with passthrough and
one source per slice, layer stacking). The output config follows the new layer count."""

from __future__ import annotations

from moemerge.architectures.config import dense_config
from moemerge.errors import MismatchError
from moemerge.merge.registry import get
from moemerge.plan.common import output_dtype, write_order
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.plan.params import resolve_merge, resolve_weights
from moemerge.plan.sources import SourceModel
from moemerge.recipe.models import MergeRecipe
from moemerge.recipe.slices import Slice, SliceSource, source_key
from moemerge.words import plural


def renamed(name: str, layer: int, to: int) -> str:
    """A layer tensor's name moved from layer `layer` to layer `to`."""
    prefix = f"model.layers.{layer}."
    assert name.startswith(prefix), name
    return f"model.layers.{to}." + name[len(prefix):]


def _job(output: str, role: str, layer: int | None, shape, dtype, recipe: MergeRecipe,
         sources: list[tuple[int, str, SliceSource]], base: int | None,
         at: tuple[int, int]) -> Job:
    """One output tensor from (model index, tensor name, recipe entry) sources; `at` = (index,
    count) of the layer in its slice, for per-layer gradients."""
    refs = [src for _, _, src in sources]
    params = resolve_merge(recipe.merge, role, layer, at=at, tensor=output, models=refs)
    # the base's tensor is read at the first source's layer
    base_source = Source(base, sources[0][1]) if base is not None else None
    if params.method == "base":
        return Job(output, shape, dtype, "copy", role, layer, (base_source,))
    if len(sources) == 1 and params.copies_its_one_model:
        return Job(output, shape, dtype, "copy", role, layer, (Source(*sources[0][:2]),))
    reads_base = get(params.method).base != "ignored"
    return Job(output, shape, dtype, "merge", role, layer,
               sources=tuple(Source(m, n) for m, n, _ in sources),
               base=base_source if reads_base else None,
               weights=resolve_weights(refs, role, layer, at=at, tensor=output), merge=params)


def plan_slices(recipe: MergeRecipe, models: list[SourceModel]) -> Plan:
    """models = [base?] + recipe.inputs. Tensors outside the layers (embeddings, final norm,
    head) are merged from the first slice's sources (embeddings) or the last slice's (the rest),
    as in mergekit."""
    assert recipe.slices
    has_base = recipe.base_model is not None
    base = 0 if has_base else None
    index = {source_key(r): i + int(has_base) for i, r in enumerate(recipe.inputs)}
    ref = models[int(has_base)]
    dtype = output_dtype(recipe.output.dtype, ref)

    def sources(s: Slice, name: str, offset: int | None) -> list[tuple[int, str, SliceSource]]:
        """The slice's sources of tensor `name` (a layer-0 name moved to each source's layer
        start + offset, or a global tensor's name as it is)."""
        return [(index[source_key(src)],
                 name if offset is None else renamed(name, 0, src.layers[0] + offset),
                 src) for src in s.sources]

    def global_jobs(embed: bool, s: Slice) -> list[Job]:
        names = [n for n in write_order(ref.roles)
                 if ref.roles[n].layer is None and (ref.roles[n].role == "embed") == embed]
        return [_job(n, ref.roles[n].role, None, ref.reader.meta(n).shape, dtype, recipe,
                     sources(s, n, None), base, (None, None)) for n in names]

    jobs = global_jobs(True, recipe.slices[0])  # embeddings first, from the first slice
    per_layer = [n for n in write_order(ref.roles) if ref.roles[n].layer == 0]
    layer_types: list = []
    for s in recipe.slices:
        for src in s.sources:
            _check_depth(models[index[source_key(src)]], src)
        first = models[index[source_key(s.sources[0])]]
        for offset in range(s.count):
            out_layer = len(layer_types)
            jobs += [_job(renamed(n, 0, out_layer), ref.roles[n].role, out_layer,
                          ref.reader.meta(n).shape, dtype, recipe, sources(s, n, offset), base,
                          (offset, s.count)) for n in per_layer]
            types = first.config.get("layer_types")
            layer_types.append(types[s.sources[0].layers[0] + offset] if types else None)
    jobs += global_jobs(False, recipe.slices[-1])  # final norm and head, from the last slice
    out_layer = len(layer_types)
    config = dense_config(ref.config, dtype)
    config["num_hidden_layers"] = out_layer
    if "layer_types" in config:
        config["layer_types"] = layer_types
    if isinstance(config.get("max_window_layers"), int):
        config["max_window_layers"] = min(config["max_window_layers"], out_layer)
    return Plan([m.label for m in models], jobs, config)


def _check_depth(model: SourceModel, src: SliceSource) -> None:
    depth = model.config.get("num_hidden_layers")
    if depth is not None and src.layers[1] > depth:
        raise MismatchError(f"slices: {model.where()} has {plural(depth, 'layer')}; layers "
                            f"{list(src.layers)} reach past them")
