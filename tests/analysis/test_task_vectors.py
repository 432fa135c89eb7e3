"""Task-vector statistics: hand-computed cases, streamed == in-memory, one read per tensor."""

from __future__ import annotations

import json
import math
import shutil
import weakref
from collections import defaultdict
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file

from moemerge.analysis import GroupStats, task_vector_report
from moemerge.analysis import task_vectors as tv
from moemerge.architectures import family_for_config

torch.set_num_threads(1)


def write_expert(base: Path, out: Path, tau) -> Path:
    """A copy of checkpoint `base` (float32) with tau(name, tensor) added to every tensor."""
    shutil.copytree(base, out)
    for file in out.glob("*.safetensors"):
        tensors = {n: t + tau(n, t) for n, t in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def base32(model_factory, tmp_path_factory) -> Path:
    """The tiny random llama in float32, so that (base + τ) − base == τ exactly."""
    out = tmp_path_factory.mktemp("tv") / "base"
    shutil.copytree(model_factory("llama"), out)
    for file in out.glob("*.safetensors"):
        save_file({n: t.float() for n, t in load_file(file).items()}, file, {"format": "pt"})
    return out


def noise(seed: int, scale: float = 0.01):
    def tau(name: str, t: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed * 1000 + len(name) * 7 + t.numel())
        return scale * torch.randn(t.shape, generator=gen)

    return tau


def test_hand_computed_four_entries():
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    a = torch.tensor([1.0, -2.0, 0.0, 3.0])  # |a|² = 14
    b = torch.tensor([2.0, 1.0, 0.0, -1.0])  # |b|² = 6; a·b = 2 − 2 − 3 = −3
    c = torch.tensor([-1.0, 0.0, 5.0, 0.0])  # |c|² = 26; a·c = −1; b·c = −2
    stats = GroupStats(3, density=0.5)
    stats.update(base, [base + a, base + b, base + c])
    r = stats.finalize("attn", 0)
    assert r.cosine[0][1] == pytest.approx(-3 / math.sqrt(14 * 6))
    assert r.cosine[0][2] == pytest.approx(-1 / math.sqrt(14 * 26))
    assert r.cosine[1][2] == pytest.approx(-2 / math.sqrt(6 * 26))
    # a, b both nonzero at entries 0, 1, 3; opposite at 1 and 3
    assert r.sign_conflict[0][1] == pytest.approx(2 / 3)
    assert r.sign_conflict[0][2] == r.sign_conflict[1][2] == 1.0  # only entry 0, opposite
    # entries with ≥ 2 nonzero τ: 0 (+, +, −), 1 (−, +), 3 (+, −): all mixed
    assert r.all_sign_conflict == 1.0
    # density 0.5 keeps the 2 largest |τ| and everything tied with the 2nd: a drops 0 and 1 →
    # 1/14; b keeps 2 and both 1s (a tie), dropping only 0 → 0; c drops two zeros → 0
    assert r.ties_trimmed_mass == pytest.approx([1 / 14, 0.0, 0.0])
    assert r.relative_norm == pytest.approx([math.sqrt(x / 30) for x in (14, 6, 26)])
    assert r.mean_cosine() == pytest.approx(sum(r.pair_cosines()) / 3)


def test_two_experts_all_sign_conflict_equals_pairwise_and_chunks_do_not_matter(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(7, 5, generator=gen)
    experts = [base + torch.randn(7, 5, generator=gen).round() for _ in range(2)]
    whole = GroupStats(2, 0.7)
    whole.update(base, experts)
    monkeypatch.setattr(tv, "CHUNK", 4)  # blocks of 4 entries, split across tensors too
    split = GroupStats(2, 0.7)
    split.update(base[:3], [e[:3] for e in experts])
    split.update(base[3:], [e[3:] for e in experts])
    a, b = whole.finalize("ffn", 1), split.finalize("ffn", 1)
    assert a.all_sign_conflict == pytest.approx(a.sign_conflict[0][1])
    for key in ("cosine", "sign_conflict", "relative_norm"):
        torch.testing.assert_close(torch.tensor(getattr(b, key)), torch.tensor(getattr(a, key)))
    assert b.numel == a.numel == 35


def test_identical_negated_and_orthogonal_task_vectors(base32, tmp_path):
    def disjoint(parity: int):
        def tau(name, t):
            mask = (torch.arange(t.numel()) % 2 == parity).reshape(t.shape)
            return noise(1)(name, t).abs() * mask + 0.001 * mask

        return tau

    same = [write_expert(base32, tmp_path / f"same{i}", noise(1)) for i in range(2)]
    neg = write_expert(base32, tmp_path / "neg", lambda n, t: -noise(1)(n, t))
    even = write_expert(base32, tmp_path / "even", disjoint(0))
    odd = write_expert(base32, tmp_path / "odd", disjoint(1))

    report = task_vector_report(base32, [*same, neg])
    assert report.names == ["same0", "same1", "neg"]
    for g in report.groups:
        assert g.cosine[0][1] == pytest.approx(1.0) and g.sign_conflict[0][1] == 0.0
        assert g.cosine[0][2] == pytest.approx(-1.0) and g.sign_conflict[0][2] == 1.0
        assert g.all_sign_conflict == 1.0
        assert g.relative_norm[0] == pytest.approx(g.relative_norm[2])

    report = task_vector_report(base32, [even, odd])
    for g in report.groups:
        assert abs(g.cosine[0][1]) < 1e-12
        assert math.isnan(g.sign_conflict[0][1]) and math.isnan(g.all_sign_conflict)


def _oracle(base: Path, experts: list[Path], density: float) -> dict:
    """Everything in memory: concatenate each group's task vectors and compute directly."""
    family = family_for_config(json.loads((base / "config.json").read_text()), "base")
    b = load_file(next(base.glob("*.safetensors")))
    es = [load_file(next(e.glob("*.safetensors"))) for e in experts]
    groups = defaultdict(list)
    for name in b:
        role = family.classify(name)
        groups[(role.role, role.layer)].append(name)
        groups[(role.role, "all")].append(name)
    out = {}
    for key, names in groups.items():
        W = torch.cat([b[n].flatten().double() for n in names])
        T = [torch.cat([(e[n].double() - b[n].double()).flatten() for n in names]) for e in es]
        cos = (T[0] @ T[1] / (T[0].norm() * T[1].norm())).item()
        both = (T[0] != 0) & (T[1] != 0)
        conflict = ((T[0].sign() != T[1].sign()) & both).sum().item() / both.sum().item()
        trimmed = []
        for e, t in zip(es, T, strict=True):
            mass = 0.0
            for n in names:
                mags = (e[n].double() - b[n].double()).abs().flatten()
                keep = math.ceil(mags.numel() * density)
                threshold = mags.sort(descending=True).values[keep - 1]
                mass += mags[mags < threshold].square().sum().item()
            trimmed.append(mass / t.square().sum().item())
        out[key] = (cos, conflict, [(t.norm() / W.norm()).item() for t in T], trimmed)
    return out


def test_streamed_equals_in_memory_concatenation(base32, tmp_path):
    experts = [write_expert(base32, tmp_path / f"e{i}", noise(i + 2, 0.02)) for i in range(2)]
    report = task_vector_report(base32, experts, density=0.6, labels=["x", "y"])
    oracle = _oracle(base32, experts, 0.6)
    summaries = [(g, (g.role, "all")) for g in report.summary.values()]
    checked = [(g, (g.role, g.layer)) for g in report.groups] + summaries
    assert len(checked) == len(oracle)
    for g, key in checked:
        cos, conflict, rel, trimmed = oracle[key]
        assert g.cosine[0][1] == pytest.approx(cos, rel=1e-9)
        assert g.sign_conflict[0][1] == pytest.approx(conflict, rel=1e-12)
        assert g.relative_norm == pytest.approx(rel, rel=1e-9)
        assert g.ties_trimmed_mass == pytest.approx(trimmed, rel=1e-5)  # τ in float32 for trim
    assert [g.role for g in report.groups][:2] == ["embed", "attn"]
    assert report.groups[0].layer is None and report.groups[1].layer == 0


def test_each_tensor_read_once_and_few_alive(base32, tmp_path, monkeypatch):
    from moemerge.io.reader import CheckpointReader

    experts = [write_expert(base32, tmp_path / f"e{i}", noise(i)) for i in range(3)]
    reads: dict[tuple[int, str], int] = defaultdict(int)
    alive = {"now": 0, "max": 0}
    original = CheckpointReader.read

    def dead() -> None:
        alive["now"] -= 1

    def counting_read(self, name, *args, **kwargs):
        tensor = original(self, name, *args, **kwargs)
        reads[(id(self), name)] += 1
        alive["now"] += 1
        alive["max"] = max(alive["max"], alive["now"])
        weakref.finalize(tensor, dead)
        return tensor

    def no_whole_file(*args, **kwargs):
        raise AssertionError("inspect must not load a whole checkpoint")

    names = load_file(next(base32.glob("*.safetensors"))).keys()
    monkeypatch.setattr(CheckpointReader, "read", counting_read)
    monkeypatch.setattr(safetensors.torch, "load_file", no_whole_file)
    task_vector_report(base32, experts)
    assert len(reads) == 4 * len(names) and set(reads.values()) == {1}
    assert alive["max"] == 4  # the base's tensor and each expert's, one name at a time


def _summary(role: str, cos: float, conflict: float = 0.2, rel: float = 0.05):
    from moemerge.analysis import GroupResult

    m = [[1.0, cos], [cos, 1.0]]
    s = [[0.0, conflict], [conflict, 0.0]]
    return GroupResult(role, None, 10, m, s, [rel, rel], [0.01, 0.01], conflict)


@pytest.mark.parametrize(
    ("attn", "ffn", "expected"),
    [
        ((0.95,), (0.95,), ["nearly identical", "averaging them is safe"]),
        ((0.03,), (0.5,), ["Attention task vectors are nearly orthogonal (mean cos 0.03): "
                           "averaging attention will interfere", "TIES with λ ≤ 0.5",
                           "attention diverged more than the FFNs"]),
        ((0.8,), (-0.3,), ["FFN task vectors conflict", "FFNs carry the specialisation"]),
        ((0.5, 0.45), (0.5,), ["partly aligned", "signs conflict often in attention"]),
        ((0.5, 0.2, 1e-4), (0.5,), ["barely moved attention"]),
    ],
)
def test_verdict_names_the_cases(attn, ffn, expected):
    from moemerge.analysis import TaskVectorReport, verdict

    summary = {"attn": _summary("attn", *attn), "ffn": _summary("ffn", *ffn)}
    report = TaskVectorReport(("base", "b"), [("x", "x"), ("y", "y")], 0.7, [], summary)
    text = verdict(report)
    for phrase in expected:
        assert phrase in text, text
