"""`record`: every reference comparison notes its measured max |Δ|; with MOEMERGE_RECORD=PATH
set, the session writes them to PATH (a markdown table for *.md, JSON otherwise) for
docs/testing.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def _measured():
    rows: list[dict] = []
    yield rows
    path = os.environ.get("MOEMERGE_RECORD")
    if not path or not rows:
        return
    if path.endswith(".md"):
        lines = ["| test | case | compared | max \\|Δ\\| |", "|---|---|---|---|"]
        lines += [f"| {r['test']} | {r['case']} | {r['what']} | {r['max_delta']:.1e} |"
                  for r in rows]
        Path(path).write_text("\n".join(lines) + "\n")
    else:
        Path(path).write_text(json.dumps(rows, indent=1) + "\n")


@pytest.fixture
def record(request, _measured):
    """record(delta, what="logits") -> delta as a float, noted under this test and case."""
    node = request.node

    def note(delta, what: str = "logits") -> float:
        value = float(delta)
        case = node.callspec.id if hasattr(node, "callspec") else ""
        _measured.append({"test": f"{Path(node.path).stem}::{node.originalname}", "case": case,
                          "what": what, "max_delta": value})
        return value

    return note
