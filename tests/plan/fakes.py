"""Checkpoints made of headers only, for planner tests: a config.json (a published one, shrunk:
moemerge/toy/published_configs.json) and the tensor names, shapes and dtypes that transformers'
own class of that config saves, with no tensor data and no file. `plan_from_headers` runs the
planning stage of a build (plan/recipe_plan.open_and_plan) on them;
a planner that reads tensor data fails (FakeReader.read).

`saved_shapes` is also what an output config must hold: its transformers class (moemerge's own
for seq_routed / bridged / merged_experts) built on the meta device, its state dict less the
tied tensors, in the on-disk names (transformers 5's conversions reverted)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch

from moemerge.loading import quiet_transformers
from moemerge.modeling import register
from moemerge.plan import sources
from moemerge.plan.jobs import Job, Plan
from moemerge.plan.recipe_plan import open_and_plan
from moemerge.plan.sources import SourceModel
from moemerge.recipe.load import parse_recipe
from moemerge.toy.published import shrunk_config

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
PUBLISHED = {  # family -> (published config, its shape keys beyond SHAPE)
    "llama": ("llama-3.2-1b", {"head_dim": 8}),  # tied embeddings
    "mistral": ("mistral-7b-v0.3", {}),  # a head of its own
    "qwen2": ("qwen2.5-1.5b", {}),  # q/k/v biases
    "qwen3": ("qwen3-1.7b", {"head_dim": 16}),  # head_dim != hidden / heads, q/k norms
    "olmo2": ("olmo-2-0425-1b", {}),  # post-norms, float32
    "granite": ("granite-3.1-2b", {}),  # multipliers
    "gemma": ("gemma-2b", {"head_dim": 16}),
    "gemma2": ("gemma-2-2b-it", {"head_dim": 16}),
    "gemma3": ("gemma-3-1b-pt", {"head_dim": 16}),
    "phi3": ("phi-3-mini-4k-instruct", {}),  # fused qkv_proj and gate_up_proj
}
FAMILIES = tuple(PUBLISHED)
FAKE_ROOT = Path("/nonexistent-fake-checkpoints")  # never read: no tokenizer.json there
NOT_CONFIG = ("model_type", "architectures", "torch_dtype", "dtype", "transformers_version",
              "auto_map")


def fake_config(family: str, **overrides) -> dict:
    """The shrunk published config.json of `family` (FAMILIES), `overrides` applied."""
    name, shape = PUBLISHED[family]
    return shrunk_config(name, **SHAPE, **shape) | overrides


@cache
def _saved(config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from transformers import AutoConfig, AutoModelForCausalLM

    register()  # moemerge's own model types
    config = json.loads(config_json)
    kwargs = {k: v for k, v in config.items() if k not in NOT_CONFIG}
    with quiet_transformers():
        made = AutoConfig.for_model(config["model_type"], **kwargs)
        # moemerge's own classes on the CPU (the configs are tiny): on transformers 4 their
        # constructor reads Gemma's embedding scale, a tensor, whose value meta has not
        with torch.device("cpu" if config["model_type"].startswith("moemerge") else "meta"):
            model = AutoModelForCausalLM.from_config(made)
    state = model.state_dict(keep_vars=True)
    try:  # transformers 5: what save_pretrained writes
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4: tied tensors are one parameter; no conversions
        seen: set[int] = set()
        state = {n: t for n, t in state.items() if id(t) not in seen and not seen.add(id(t))}
    else:
        state = revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))
    return tuple(sorted((n, tuple(t.shape)) for n, t in state.items()))


def saved_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} that transformers' class for `config` saves (no memory used)."""
    return dict(_saved(json.dumps(config, sort_keys=True)))


@dataclass(frozen=True)
class FakeMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class FakeReader:
    """What a planner sees of a CheckpointReader: `config`, `names()`, `metas`, `meta()`,
    `in`. Reading data is a test failure."""

    def __init__(self, config: dict, shapes: dict[str, tuple[int, ...]] | None = None,
                 dtype: torch.dtype | None = None):
        self.config = config
        shapes = saved_shapes(config) if shapes is None else shapes
        dtype = dtype or getattr(torch, config.get("torch_dtype") or "float32")
        self.metas = {n: FakeMeta(n, dtype, tuple(s)) for n, s in shapes.items()}

    def names(self) -> list[str]:
        return list(self.metas)

    def __contains__(self, name: object) -> bool:
        return name in self.metas

    def meta(self, name: str) -> FakeMeta:
        return self.metas[name]

    def read(self, name: str):
        raise AssertionError(f"a planner read tensor data ({name!r}); plans use headers only")

    def __enter__(self) -> FakeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def fake(family: str, *, changed: dict[str, tuple[int, ...]] | None = None,
         **overrides) -> FakeReader:
    """A fake checkpoint of `family`; `changed` replaces some tensors' shapes in its headers."""
    reader = FakeReader(fake_config(family, **overrides))
    for name, shape in (changed or {}).items():
        assert name in reader, name
        reader.metas[name] = FakeMeta(name, reader.metas[name].dtype, shape)
    return reader


def plan_from_headers(recipe: dict, checkpoints: dict[str, FakeReader]) -> tuple[Plan,
                                                                              list[SourceModel]]:
    """What `moemerge build --dry-run` plans for `recipe` (a recipe as YAML loads it, whose model
    references are keys of `checkpoints`), and the models it planned from."""
    parsed = parse_recipe(recipe, "<test recipe>")

    def resolve(refs, recipe_dir):
        return [FAKE_ROOT / ref.model for _, ref in refs]

    def reader(path: Path, *, allow_pickle: bool, per_expert: bool) -> FakeReader:
        return checkpoints[path.relative_to(FAKE_ROOT).as_posix()]

    with ExitStack() as stack, pytest.MonkeyPatch.context() as patch:
        patch.setattr(sources, "resolve_refs", resolve)
        patch.setattr(sources, "CheckpointReader", reader)
        models, plan = open_and_plan(parsed, None, allow_pickle=False, stack=stack)
    return plan, models


def leaves(jobs: list[Job]) -> dict[str, Job]:
    """Every job by output name, the parts of fused jobs included (GraniteMoE's experts, Phi-3's
    q, k, v): what is made before it is fused."""
    found = {}
    for job in jobs:
        found[job.output] = job
        found.update(leaves([p for group in job.parts for p in group]))
    return found


def check_plan(plan: Plan, models: list[SourceModel]) -> None:
    """What holds for every plan: one job per output, every tensor a job reads is in its
    model's headers (its rows inside the tensor), a copy keeps its source's shape (after its
    change), a fused job's
    parts add up to it, and the planned config's dtype is every job's (curvature: float32)."""
    outputs = [job.output for job in plan.jobs]
    assert len(outputs) == len(set(outputs)), "an output tensor planned twice"
    assert len(plan.labels) == len(models)
    for job in leaves(plan.jobs).values():
        for source in job.inputs:
            reader = models[source.model].reader
            assert source.tensor in reader, (job.output, source)
            shape = tuple(reader.meta(source.tensor).shape)
            if source.rows is not None:
                first, end = source.rows
                assert 0 <= first < end <= shape[0], (job.output, source, shape)
                shape = (end - first, *shape[1:])
            if source.change is not None:
                shape = tuple(source.change.shape(shape))
            if job.operation == "copy":
                assert shape == tuple(job.shape), (job.output, source, shape, job.shape)
        if job.operation == "fuse":
            rows = [sum(p.shape[0] for p in group) for group in job.parts]
            assert set(rows) == {job.shape[-2] if len(job.shape) == 3 else job.shape[0]}, job
        expected = torch.float32 if job.role == "curvature" else plan_dtype(plan)
        assert job.dtype == expected, (job.output, job.dtype, expected)


def plan_dtype(plan: Plan) -> torch.dtype:
    return getattr(torch, plan.config.get("torch_dtype") or plan.config["dtype"])


def planned_shapes(plan: Plan) -> dict[str, tuple[int, ...]]:
    return {job.output: tuple(job.shape) for job in plan.jobs}
