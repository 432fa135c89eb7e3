"""Every table moemerge prints fits an 80-column terminal whole: no cell cut to `…`, no number
broken over lines, and the numbers printed are the --json report's (issue 23: at 80 columns
`inspect` printed `0.05…` and `lm_he…`)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from conftest import perturbed_copy
from rich.console import Console

from moemerge.merge.registry import METHOD_NAMES
from moemerge.terminal_tables import Column, Fitted

WIDTH = 80
MOEMERGE = [sys.executable, "-m", "moemerge"]


def cli(*args, columns: int = WIDTH) -> str:
    """stdout + stderr of `moemerge ARGS` in a fresh process whose console is `columns` wide."""
    env = os.environ | {"COLUMNS": str(columns), "NO_COLOR": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*MOEMERGE, *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def in_terminal(*args, columns: int = WIDTH) -> str:
    """What `moemerge ARGS` shows in a pseudo-terminal `columns` wide (escape codes removed)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([*MOEMERGE, *map(str, args)], stdin=follower, stdout=follower,
                            stderr=follower, env=env | {"OMP_NUM_THREADS": "1"})
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the process is done
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=300) == 0
    text = b"".join(chunks).decode()
    # a carriage return alone redraws the line (a progress spinner): each drawing its own line
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text).replace("\r\n", "\n").replace("\r", "\n")


def assert_fits(text: str, width: int = WIDTH) -> None:
    for line in text.splitlines():
        assert len(line) <= width, (len(line), line)
        if line.startswith("│"):
            assert "…" not in line, line


def rows(text: str) -> list[list[str]]:
    """The cells of every table row printed (lines between │ borders)."""
    return [[c.strip() for c in line.strip("│").split("│")]
            for line in text.splitlines() if line.startswith("│")]


def number(cell: str) -> float:
    return float(cell.rstrip("%")) / (100 if cell.endswith("%") else 1)


@pytest.fixture(scope="module")
def experts(model_factory, tmp_path_factory):
    """A base and five experts whose names are too long for a column (E1..E5 and a legend)."""
    base = model_factory("llama")
    root = tmp_path_factory.mktemp("fit")
    return base, [perturbed_copy(base, root / f"domain-expert-number-{i}", scale=0.02, seed=i)
                  for i in range(5)]


def test_inspect_task_vectors_fits_80_columns_with_every_digit(experts, tmp_path):
    base, paths = experts
    text = cli("inspect", base, *paths, "--json", tmp_path / "r.json", "-q")
    assert_fits(text)
    doc = json.loads((tmp_path / "r.json").read_text())
    names = [e["name"] for e in doc["experts"]]
    flat = " ".join(text.split())
    for i, name in enumerate(names):  # long expert names: a short label, and a legend
        assert f"E{i + 1} = {name}" in flat
    groups = {(g["role"], "global" if g["layer"] is None else str(g["layer"])): g
              for g in doc["groups"]}
    seen = {"pairs": 0, "norms": 0}
    for cells in rows(text):
        key = tuple(cells[:2])
        if key not in groups:
            continue
        group = groups[key]
        values = [number(c) for c in cells[2:]]
        if len(cells) == 6:  # role, layer, mean cos, min cos, sign conflict, all-sign conflict
            pair = group["pairs"]
            mean_sign = sum(p["sign_conflict"] for p in pair) / len(pair)
            expected = [group["mean_cosine"], group["min_cosine"], mean_sign,
                        group["all_sign_conflict"]]
            assert values[:2] == pytest.approx(expected[:2], abs=0.005 + 1e-9), (cells, group)
            assert values[2:] == pytest.approx(expected[2:], abs=0.005 + 1e-9), (cells, group)
            seen["pairs"] += 1
        else:  # role, layer, ‖τ‖/‖W‖ of some experts (3 significant digits)
            norms = [e["relative_norm"] for e in group["experts"]]
            assert any(values == pytest.approx(norms[i:i + len(values)], rel=5e-3)
                       for i in range(len(norms) - len(values) + 1)), (cells, norms)
            seen["norms"] += len(values)
    assert seen == {"pairs": len(groups), "norms": len(groups) * len(names)}, seen


def test_inspect_routing_fits_80_columns(tiny_moe, train_text, tmp_path):
    text = cli("inspect", "routing", tiny_moe, "--data", f"code={train_text}", "--seq-len", 16,
               "--per-layer", "--json", tmp_path / "r.json")
    assert_fits(text)
    doc = json.loads((tmp_path / "r.json").read_text())
    shares = [number(c) for c in rows(text)[0][1:-2]]
    assert shares == pytest.approx(doc["domains"]["code"]["mean_share"], abs=5e-4 + 1e-9)


def test_methods_and_the_dry_run_plan_fit_80_columns(tiny_moe):
    text = cli("methods")
    assert_fits(text)
    # a line or two per method (with every parameter it was 113 lines): those are `methods NAME`'s
    assert len(text.splitlines()) <= 50, text
    assert all(f"│ {name} " in text for name in METHOD_NAMES), text
    assert "moemerge methods NAME" in " ".join(text.split())
    ties = cli("methods", "ties")
    assert_fits(ties)
    assert "trim_rounding" in ties and "ceil" in ties  # not broken
    plan = in_terminal("build", tiny_moe / "moemerge_recipe.yaml", tiny_moe.parent / "unused",
                       "--dry-run")
    assert_fits(plan)
    assert "model.layers.0.block_sparse_moe.experts.1.w2.weight" in plan.splitlines()


@pytest.mark.parametrize("width", [40, 80, 200])
def test_fitted_splits_columns_it_cannot_fit_and_never_cuts_a_cell(width):
    """Twelve value columns: as many tables as the width needs, each repeating the key
    columns, every value whole; headers too long for their column become labels."""
    columns = [Column("role", "left", key=True), Column("layer", "left", key=True)]
    columns += [Column(f"expert-with-a-long-name-{i}", short=f"E{i + 1}") for i in range(12)]
    values = [[f"{0.001234 * (i + 1) * (r + 1):#.3g}" for i in range(12)] for r in range(3)]
    console = Console(width=width, record=True, color_system=None)
    console.print(Fitted(columns, [["lm_head", str(r), *v] for r, v in enumerate(values)],
                         title="t"))
    text = console.export_text()
    assert_fits(text, width)
    printed = [c for row in rows(text) for c in row[2:]]
    assert sorted(printed) == sorted(v for row in values for v in row)
    assert all(row[0] == "lm_head" for row in rows(text))
    assert "E12 = expert-with-a-long-name-11" in " ".join(text.split())


def test_route_table_fits_80_columns(tmp_path, model_factory):
    """The prompt column takes what the others leave; weights are never cut."""
    from moemerge.api import build

    base = model_factory("llama")
    paths = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.3, seed=i, only="layers.")
             for i in range(3)]
    lines = ["kind: moe", "assembly: seq_routed", f"base_model: {base}", "experts:"]
    lines += [f"  - {{model: {p}, name: expert-{n}}}" for p, n in zip(paths, "abc", strict=True)]
    lines += ["router: {kind: task_vector}", "experts_per_sequence: 3"]
    (tmp_path / "r.yaml").write_text("\n".join(lines) + "\n")
    build(tmp_path / "r.yaml", tmp_path / "moe", progress=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\n    return a + b\n\n" + "The sum of two numbers. " * 8)
    text = cli("route", tmp_path / "moe", prompts, "--json", tmp_path / "r.json")
    for line in text.splitlines():
        assert len(line) <= WIDTH, line
    doc = json.loads((tmp_path / "r.json").read_text())
    table = rows(text)
    weights = [re.findall(r"\((\d\.\d\d)\)", cells[-1]) for cells in table]
    shown = [float(w) for ws in weights for w in ws]
    expected = [round(e["weight"], 2) for p in doc["prompts"] for e in p["experts"]]
    assert shown == pytest.approx(expected, abs=1e-9)
    assert Path(prompts).read_text()[:10].replace("\n", "⏎") in text
