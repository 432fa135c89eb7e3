"""Every outside program moemerge runs goes through `run_tool`: the C compiler (merge/native)
and llama.cpp's converter (finish/gguf). tests/security/test_subprocesses.py lists the call
sites and fails on a new one, or on a module that imports subprocess itself.

Each run has a time limit, a program path resolved to an absolute one (a relative name found
in the working directory is never run by accident), and its own process group, so a timeout or
an interrupt stops the program and whatever it started.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from moemerge.errors import ToolError


def resolve_program(program: str | Path, what: str) -> Path:
    """The absolute path of `program`: a path as given (made absolute), a bare name looked up
    on PATH only. A ToolError naming `what` when there is none."""
    if os.sep in str(program) or Path(program).is_absolute():
        found = Path(program).absolute()
        if not (found.is_file() and os.access(found, os.X_OK)):
            raise ToolError(f"{what}: {found} is not an executable file")
        return found
    located = shutil.which(str(program))
    if located is None:
        raise ToolError(f"{what}: {program!r} is not on PATH")
    return Path(located).absolute()


def run_tool(argv: Sequence[str | Path], *, what: str, timeout: float,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run argv (argv[0] an absolute path, see `resolve_program`) to its end, output captured
    as text, within `timeout` seconds. On a timeout (or Ctrl-C / SIGTERM) the program's whole
    process group is killed; a timeout is a ToolError naming `what`. The exit code is the
    caller's to judge."""
    command = [str(a) for a in argv]
    if not Path(command[0]).is_absolute():
        raise ValueError(f"run_tool needs an absolute program path, got {command[0]!r}")
    if not timeout > 0:
        raise ValueError(f"run_tool needs a positive time limit, got {timeout!r}")
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ToolError(f"{what} ({command[0]}) did not finish within {timeout:g} s and was "
                        "stopped") from None
    except BaseException:
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


def last_lines(done: subprocess.CompletedProcess, count: int = 15) -> str:
    """The last `count` lines a finished program printed (stderr, else stdout)."""
    return "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-count:])
