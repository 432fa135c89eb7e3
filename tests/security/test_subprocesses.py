"""Every outside program moemerge runs has a time limit, an absolute path shown before it runs,
and a clean error for whatever it does wrong (docs/security.md, "Outside programs").

The enumeration: moemerge.external is the only module that imports subprocess, and run_tool is
called from the listed places only, each with a time limit; a new call site fails here until it
is listed (and bounded). Then llama.cpp's converter as a hostile or broken program: it never
returns, exits 0 without output, leaves a directory or a symlink, or sits in the working
directory behind a relative $LLAMA_CPP_DIR."""

import ast
import os
import sys
import time
from pathlib import Path

import pytest

from moemerge.errors import Note, RecipeError, ToolError
from moemerge.external import resolve_program, run_tool
from moemerge.finish.gguf import find_converter, write_gguf

PACKAGE = Path(__file__).resolve().parents[2] / "moemerge"
# (module, function) of every run_tool call: the compiler's version and build, the converter
CALL_SITES = {
    ("merge/native/__init__.py", "_key"),
    ("merge/native/__init__.py", "_compile"),
    ("finish/gguf.py", "write_gguf"),
}
SPAWNERS = {"subprocess", "multiprocessing", "pty", "pexpect", "sh"}
OS_SPAWNS = ("system", "popen", "exec", "spawn", "fork", "posix_spawn")


def problems(source: str, module: str) -> tuple[list[str], set[tuple[str, str]]]:
    """(what in `source` starts a program other than through run_tool, or calls run_tool without
    a time limit; the (module, function) of each run_tool call)."""
    found, sites = [], set()
    tree = ast.parse(source)
    scopes = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for inner in ast.walk(node):
                scopes.setdefault(id(inner), node.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and module != "external.py":
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""]
            found += [f"{module}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in SPAWNERS]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "os" and node.attr.startswith(OS_SPAWNS):
            found.append(f"{module}:{node.lineno} calls os.{node.attr}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_tool":
            sites.add((module, scopes.get(id(node), "<module>")))
            limit = next((k.value for k in node.keywords if k.arg == "timeout"), None)
            if limit is None or (isinstance(limit, ast.Constant) and limit.value is None):
                found.append(f"{module}:{node.lineno} runs a program with no time limit")
    return found, sites


def test_every_program_moemerge_runs_is_listed_and_bounded():
    found, sites = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        more, where = problems(path.read_text(), path.relative_to(PACKAGE).as_posix())
        found += more
        sites |= where
    assert not found
    assert sites == CALL_SITES, "a new program call: bound it and list it in CALL_SITES"


@pytest.mark.parametrize("source, expected", [
    ("import subprocess\nsubprocess.run(['x'])\n", "imports subprocess"),
    ("from multiprocessing import Pool\n", "imports multiprocessing"),
    ("import os\nos.system('x')\n", "calls os.system"),
    ("import os\nos.execv('/bin/x', [])\n", "calls os.execv"),
    ("def f():\n    run_tool(['/bin/x'], what='x')\n", "no time limit"),
    ("def f():\n    run_tool(['/bin/x'], what='x', timeout=None)\n", "no time limit"),
])
def test_the_enumeration_catches_an_unbounded_program(source, expected):
    found, _ = problems(source, "new.py")
    assert any(expected in f for f in found), found


def test_a_new_call_site_is_caught():
    _, sites = problems("def g():\n    run_tool(['/bin/x'], what='x', timeout=1)\n", "new.py")
    assert sites == {("new.py", "g")} and not sites <= CALL_SITES


def test_a_program_that_never_returns_is_stopped_with_what_it_started(tmp_path):
    child = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    script.write_text("import subprocess, sys, time\n"
                      "p = subprocess.Popen([sys.executable, '-c', "
                      "'import time; time.sleep(60)'])\n"
                      f"open({str(child)!r}, 'w').write(str(p.pid))\n"
                      "time.sleep(60)\n")
    start = time.monotonic()
    with pytest.raises(ToolError, match=r"hanging tool \(.*python.*\) did not finish within 1 s"):
        run_tool([sys.executable, script], what="a hanging tool", timeout=1)
    assert time.monotonic() - start < 20
    pid = int(child.read_text())
    for _ in range(100):  # the grandchild is killed with the group (reaped by init)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the converter's child {pid} still runs")


def test_programs_are_run_by_absolute_path_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="absolute"):
        run_tool(["python3", "-c", "pass"], what="x", timeout=5)
    with pytest.raises(ToolError, match="not on PATH"):
        resolve_program("no-such-compiler-here", "the C compiler")
    (tmp_path / "cc").write_text("#!/bin/sh\ntouch owned\n")
    (tmp_path / "cc").chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ToolError, match="not on PATH"):  # never ./cc
        resolve_program("cc", "the C compiler")
    assert resolve_program("./cc", "the C compiler") == tmp_path / "cc"


def converter(tmp_path: Path, body: str) -> list[str]:
    """A fake convert_hf_to_gguf.py: `body` runs with `out` the --outfile path."""
    script = tmp_path / "convert_hf_to_gguf.py"
    script.write_text("import os, sys, time\nfrom pathlib import Path\nargs = sys.argv[1:]\n"
                      "out = Path(args[args.index('--outfile') + 1])\n" + body)
    return [sys.executable, str(script)]


@pytest.mark.parametrize("body, message", [
    ("", "exited 0 but wrote no model-f16.gguf.partial"),
    ("out.mkdir()\n", "left model-f16.gguf.partial as a directory"),
    ("out.symlink_to('/etc/passwd')\n",
     "left model-f16.gguf.partial as a symlink (to /etc/passwd)"),
    ("out.write_bytes(b'not a gguf')\n", "without GGUF's magic bytes"),
    ("out.write_bytes(b'GGUF'); time.sleep(60)\n", "did not finish within 2 s"),
])
def test_a_converter_that_misbehaves_leaves_no_gguf(tmp_path, body, message):
    model = tmp_path / "model"
    model.mkdir()
    passwd = Path("/etc/passwd").read_bytes()
    with pytest.warns(Note, match=r"running llama.cpp's converter: /\S*python\S* /\S*convert_hf"):
        with pytest.raises(ToolError) as raised:
            write_gguf(model, "f16", converter(tmp_path, body), timeout=2)
    assert message in str(raised.value) and "model-f16.gguf" in str(raised.value)
    assert sorted(p.name for p in model.iterdir()) == []  # no .gguf, no .partial of any kind
    assert Path("/etc/passwd").read_bytes() == passwd


def test_a_well_behaved_converter_gives_the_gguf(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.warns(Note):
        out = write_gguf(model, "f16", converter(tmp_path, "out.write_bytes(b'GGUF' + bytes(8))\n"),
                         timeout=30)
    assert out == model / "model-f16.gguf" and out.read_bytes().startswith(b"GGUF")


def test_a_relative_llama_cpp_dir_never_runs_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "convert_hf_to_gguf.py").write_text("open('owned', 'w')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LLAMA_CPP_DIR", ".")
    with pytest.raises(RecipeError, match=r"\$LLAMA_CPP_DIR is '\.', a relative path"):
        find_converter(None)
    # given on the command line, a relative directory is the user's own words: made absolute
    command = find_converter(Path("."))
    assert command[1] == str(tmp_path / "convert_hf_to_gguf.py")
    assert all(Path(part).is_absolute() for part in command)
    assert not (tmp_path / "owned").exists()
