"""benchmarks/stamp.py, the provenance record of a benchmark result; every script that writes to
benchmarks/results/ uses it, and benchmarks/README.md lists every result file (no torch here)."""

import importlib.metadata
import importlib.util
import platform
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCHMARKS / "results"
# writers that stamp nothing themselves: report.py re-renders quality.json, whose stamp run.py
# wrote when it measured
PENDING = {"quality/report.py"}
KEYS = ["commit", "dirty", "date", "python", "moemerge", "torch", "transformers", "safetensors",
        "machine", "cpus", "torch_threads", "memory_gib", "gpu"]


def load_stamp():
    spec = importlib.util.spec_from_file_location("benchmark_stamp", BENCHMARKS / "stamp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def writers() -> list[str]:
    """Every benchmark script that writes into benchmarks/results/ (a path joined with it)."""
    return sorted(str(p.relative_to(BENCHMARKS)) for p in BENCHMARKS.rglob("*.py")
                  if p.name != "stamp.py" and '/ "results"' in p.read_text())


def test_provenance_has_the_expected_keys():
    stamp = load_stamp()
    record = stamp.provenance()
    assert list(record) == KEYS
    assert record["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}", record["commit"])
    assert record["dirty"] in (None, True, False)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", record["date"])
    assert record["python"] == platform.python_version()
    for package in ("moemerge", "torch", "transformers", "safetensors"):
        assert record[package] == importlib.metadata.version(package)
    assert record["machine"] == platform.machine() and record["cpus"] >= 1
    assert record["torch_threads"] is None or record["torch_threads"] >= 1
    line = stamp.stamp_line(record)
    assert line.startswith("Provenance: ") and "\n" not in line
    assert f"transformers {record['transformers']}" in line and record["date"] in line


def test_provenance_imports_no_torch():
    # bench_build.py's parent stays free of torch: its children's peak RSS starts at its own
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import stamp; stamp.provenance(); "
            "assert 'torch' not in sys.modules, 'stamp imported torch'")
    subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], check=True)


def test_outside_git_the_commit_comes_from_the_environment(tmp_path, monkeypatch):
    stamp = load_stamp()
    monkeypatch.setattr(stamp, "ROOT", tmp_path)
    monkeypatch.setenv("MOEMERGE_COMMIT", "abc1234")
    record = stamp.provenance()
    assert record["commit"] == "abc1234" and record["dirty"] is None
    assert stamp.commit_text(None) == "commit not recorded"
    assert stamp.parts_line({"a": record, "b": record}, "cases") == (
        f"Cases made at: commit abc1234 on {record['date'][:10]} (all 2).")


def test_every_results_writer_stamps_its_results():
    found = writers()
    assert "bench_build.py" in found and "downstream/run.py" in found  # the scan finds them
    assert PENDING <= set(found), "a pending writer moved: update PENDING"
    missing = [name for name in found if name not in PENDING and not (
        re.search(r"^from stamp import .*\bprovenance\b", (BENCHMARKS / name).read_text(), re.M)
        and "provenance()" in (BENCHMARKS / name).read_text())]
    assert not missing, f"{missing} write benchmarks/results/ without stamp.provenance()"


def test_the_index_lists_every_script_and_result_file():
    index = (BENCHMARKS / "README.md").read_text()
    unlisted = [name for name in writers() if f"`{name}" not in index]
    assert not unlisted, f"{unlisted}: add a row to benchmarks/README.md"
    files = [str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file()]
    unlinked = [f for f in files if f"(results/{f})" not in index]
    assert not unlinked, (f"{unlinked}: link each from benchmarks/README.md's index, or move it "
                          "to benchmarks/results/archive/ with a line there saying what it was")
