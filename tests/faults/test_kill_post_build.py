"""Issue 41: kill -9 or SIGTERM while `shrink`, `extend`, `extract` and a `kind: stages` build
write their tensors. Each signal lands at a known point, not a random one: in the process that
is killed, `ShardedWriter._put` (the one step every `write` and `copy` of moemerge/io/writer.py
goes through) is patched to create a marker file once the first tensor is in the output's
temporary directory, then to sleep; the test sends the signal when the marker appears.

After the kill nothing half-written looks complete: OUT does not exist, every model directory
there is (a finished stage) is the uninterrupted run's, bytes and all, and what the write left
is only the killed process's temporary directory (kill -9: a shard, no config.json), which the
next run removes. SIGTERM exits 143 and leaves nothing. The next run's output is byte-identical
to an uninterrupted run's.

Every run is a fork of one Python that has imported moemerge, torch and transformers once (a
fresh interpreter spends ~4 s of each run importing them), with OMP_NUM_THREADS=1 as
test_kill.py runs its commands; the patch does nothing in a run that is not to be killed.
"""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import TEXT, perturbed_copy, write_recipe

ROOT = Path(__file__).resolve().parents[2]
LANDED = {signal.SIGTERM: 143, signal.SIGKILL: -signal.SIGKILL}
WAIT = 120  # seconds a run may take to reach its first tensor (or to finish)

# The fork server: reads one JSON request a line ({"argv", "log", "kill"}), forks, runs
# `moemerge argv` in the child with stdout and stderr to `log`, and prints the child's pid, then
# its exit code (-N: killed by signal N). With "kill" ({"marker", "prefix"}), the child's
# `_put` of a writer whose directory's name starts with `prefix` creates `marker` (holding that
# directory) after its first tensor, then sleeps until the test's signal comes.
ZYGOTE = r'''
import json, os, sys, time, traceback
from pathlib import Path

from moemerge.io import writer

KILL = {}
_put = writer.ShardedWriter._put


def _put_then_wait(self, name, shard, put):
    _put(self, name, shard, put)
    if KILL and self.directory.name.startswith(KILL["prefix"]):
        Path(KILL["marker"] + ".part").write_text(str(self.directory))
        os.replace(KILL["marker"] + ".part", KILL["marker"])  # whole when it appears
        time.sleep(60)  # the test's signal lands here, one tensor written


writer.ShardedWriter._put = _put_then_wait

import transformers  # noqa: E402,F401
from transformers import LlamaForCausalLM, MixtralForCausalLM  # noqa: E402,F401

import moemerge.api, moemerge.built.extend.command, moemerge.built.extract  # noqa: E402,F401
import moemerge.built.shrink, moemerge.stage_runner  # noqa: E402,F401
from moemerge.cli import app  # noqa: E402

print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            KILL.update(request["kill"] or {})
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            app(args=request["argv"], prog_name="moemerge")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(pid, flush=True)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
'''


class Runner:
    """moemerge runs, each in a fork of the ZYGOTE process."""

    def __init__(self, scratch: Path):
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], env=env, bufsize=0,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.scratch, self.count, self.buffer = scratch, 0, b""

    def line(self, timeout: float = WAIT) -> str:
        """The zygote's next line; its own buffer, so that select() sees what is unread."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError("the fork server said nothing")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the fork server exited ({self.proc.wait()})")
            self.buffer += chunk
        text, self.buffer = self.buffer.split(b"\n", 1)
        return text.decode()

    def ended(self) -> bool:
        """The current run has exited (its exit code is waiting, unread)."""
        return b"\n" in self.buffer or bool(select.select([self.proc.stdout], [], [], 0)[0])

    def start(self, argv: list, kill: dict | None = None) -> tuple[int, Path]:
        self.count += 1
        log = self.scratch / f"run-{self.count}.log"
        request = {"argv": [str(a) for a in argv], "log": str(log), "kill": kill}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        return int(self.line()), log

    def finish(self, log: Path) -> tuple[int, str]:
        return int(self.line()), log.read_text()

    def run(self, argv: list) -> tuple[int, str]:
        return self.finish(self.start(argv)[1])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("runs")
    forks = Runner(scratch)  # imports while the inputs are made
    yield forks
    forks.close()


@pytest.fixture(scope="module")
def inputs(runner, model_factory, tmp_path_factory):
    """A calibrated token-routed MoE of two experts (what extend needs: its router statistics),
    a third expert, calibration text, and a stages recipe: a task-arithmetic merge of two
    experts (a method the compiled kernel, built once per cache in ~10 s, has no part in), then
    an MoE of that merge and the third expert."""
    from moemerge.api import build

    root = tmp_path_factory.mktemp("inputs")
    base = model_factory("llama")
    e0, e1, e2 = (perturbed_copy(base, root / f"e{i}", scale=0.05, seed=i, only="mlp")
                  for i in range(3))
    text = root / "code.txt"
    text.write_text(TEXT * 40)
    moe = write_recipe(root / "moe.yaml", yaml.safe_dump({
        "kind": "moe", "base_model": str(base), "experts_per_token": 1,
        "experts": [{"model": str(e0), "name": "a"}, {"model": str(e1), "name": "b"}],
        "calibration": {"data": [f"a={text}", f"b={text}"], "max_tokens": 256,
                        "seq_len": 16}}))
    build(moe, root / "moe", progress=False, verify="structure")
    stages = write_recipe(root / "stages.yaml", yaml.safe_dump({"kind": "stages", "stages": [
        {"recipe": {"kind": "moe", "base_model": str(base), "router": {"init": "random"},
                    "experts": ["pair", str(e2)]}},
        {"name": "pair", "recipe": {"kind": "merge", "base_model": str(base),
                                    "merge": {"method": "task_arithmetic"},
                                    "models": [str(e0), str(e1)]}}]}))
    assert runner.line() == "ready"
    return {"moe": root / "moe", "expert": e2, "text": text, "stages": stages}


def argv(command: str, i: dict, out: Path) -> list:
    if command == "shrink":
        return ["shrink", i["moe"], out, "--experts", "1", "--calibration", i["text"],
                "--seq-len", "16", "-q"]
    if command == "extend":
        return ["extend", i["moe"], out, "--expert", i["expert"], "--name", "c",
                "--calibration", f"c={i['text']}", "--keep-shared"]
    if command == "extract":
        return ["extract", i["moe"], out, "--expert", "0"]
    # a finished stage is not replaced without --force
    return ["build", i["stages"], out, "-q", "--force"]


# case: (command, the output directory whose tensor write the signal interrupts)
CASES = {
    "shrink": ("shrink", "out"),
    "extend": ("extend", "out"),
    "extract": ("extract", "out"),
    "stages-output": ("stages", "out"),  # the last stage; `pair` is finished by then
    "stages-inner": ("stages", "pair"),  # the first stage, in out.stages/
}


def tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def temporary(path: Path) -> bool:
    return "moemerge-tmp-" in path.name or "moemerge-old-" in path.name


def leftovers(work: Path) -> list[Path]:
    return sorted(Path(top, name) for top, dirs, files in os.walk(work)
                  for name in dirs + files if temporary(Path(name)))


def clear(work: Path) -> Path:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return work


@pytest.fixture(scope="module")
def reference(runner, inputs, tmp_path_factory):
    """Per command, every file an uninterrupted run writes (its own directory), run in the
    directory the kills then use: a stage's recipe copy names the stages' absolute paths."""
    work, made = tmp_path_factory.mktemp("work"), {}

    def of(command: str) -> tuple[Path, dict[str, bytes]]:
        if command not in made:
            clear(work / command)
            code, text = runner.run(argv(command, inputs, work / command / "out"))
            assert code == 0, text
            made[command] = tree(work / command)
            assert "out/config.json" in made[command] and \
                any(name.endswith(".safetensors") for name in made[command])
            clear(work / command)
        return work / command, made[command]

    return of


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
@pytest.mark.parametrize("case", list(CASES))
def test_killed_while_writing_leaves_nothing_complete_and_reruns_identically(
        case, sig, runner, inputs, reference):
    command, target = CASES[case]
    work, expected = reference(command)
    out = work / "out"
    clear(work)
    marker = work.parent / f"{case}.written"  # the killed run's first tensor is written
    marker.unlink(missing_ok=True)
    args = argv(command, inputs, out)
    pid, log = runner.start(args, kill={"marker": str(marker),
                                        "prefix": f".{target}.moemerge-tmp-"})
    sent = False
    try:
        deadline = time.monotonic() + WAIT
        while not marker.exists() and not runner.ended() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert marker.exists(), f"{case}: no tensor was written through ShardedWriter._put"
        writing = Path(marker.read_text())  # where the first tensor went: its own temporary dir
        assert writing.name.startswith(f".{target}.moemerge-tmp-{pid}-"), writing
        assert writing.parent == (work if target == "out" else work / "out.stages")
        assert list(writing.glob("*.safetensors")) and not (writing / "config.json").exists()
        os.kill(pid, sig)
        sent = True
    finally:
        if not sent and not runner.ended():  # a check above failed: do not leave it sleeping
            os.kill(pid, signal.SIGKILL)
        code, text = runner.finish(log)
    assert code == LANDED[sig], text

    # nothing half-written looks complete: no OUT, and outside temporary directories only
    # what was finished (a stages build's first stage), byte for byte the uninterrupted run's
    assert not out.exists(), f"{case}: {out} exists after {sig.name}"
    finished = "out.stages/pair/" if case == "stages-output" else None
    assert {k: v for k, v in tree(work).items()
            if not any(temporary(Path(part)) for part in Path(k).parts)} == \
        {k: v for k, v in expected.items() if finished and k.startswith(finished)}
    stale = leftovers(work)
    if sig == signal.SIGTERM:  # handled: the process removed its own
        assert stale == [], (stale, text)
        assert "no output was left behind" in " ".join(text.split()), text
    else:  # only the killed run's directory, its shard half-written, no config.json
        assert stale == [writing], stale
        assert list(writing.glob("*.safetensors")) and not (writing / "config.json").exists()

    code, text = runner.run(args)
    assert code == 0, text
    assert leftovers(work) == []  # the dead run's directory is swept
    assert tree(work) == expected  # OUT, and a stages build's out.stages/, byte for byte
    clear(work)
