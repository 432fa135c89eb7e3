"""Item 11: kill -9 or SIGTERM at random points of a build and of a finetune (fixed seed).
Each signal must land while the command works (else the run is repeated with a shorter delay,
a bounded number of times): SIGTERM is handled (exit 143) and leaves nothing; SIGKILL (-9)
leaves a temporary directory that the next run for the same output removes. The final output
is byte-identical to an uninterrupted run's."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import perturbed_copy, write_recipe

ROOT = Path(__file__).resolve().parents[2]
LANDED = {signal.SIGTERM: 143, signal.SIGKILL: -signal.SIGKILL}  # the exit code of a hit
DELAYS = (1.0, 0.5, 0.25, 0.0)  # of the spread: each retry kills sooner after `ready`


def start(*args):
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-m", "moemerge", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc):
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err


def leftovers(parent: Path) -> list[Path]:
    """Temporary files and directories under `parent`. os.walk, unlike Path.rglob, skips a
    directory that the running command removes while it is being listed."""
    found = []
    for top, dirs, files in os.walk(parent):
        found += [Path(top, name) for name in dirs + files]
    return sorted(p for p in found if ".tmp-" in p.name or "moemerge-" in p.name)


def owned(parent: Path, pid: int) -> list[Path]:
    """The temporary directories of process `pid` (their names carry it)."""
    return [p for p in leftovers(parent) if f"-{pid}-" in p.name]


def kill_run(args, sig, ready, rng, spread, hit=lambda proc: True):
    """Run moemerge `args` and send `sig` at a random point of the `spread` seconds after
    `ready(proc)` (the work is under way). A signal that came too late (the run had finished,
    or SIGTERM reached the interpreter's shutdown) is tried again with a shorter delay;
    `hit(proc)`, checked at the kill, may demand more. Returns (pid, output, tries)."""
    for tries, fraction in enumerate(DELAYS, start=1):
        proc = start(*args)
        while proc.poll() is None and not ready(proc):
            time.sleep(0.002)
        time.sleep(rng.uniform(0, spread * fraction))
        landed = proc.poll() is None and hit(proc)
        if proc.poll() is None:
            proc.send_signal(sig)
        code, text = finish(proc)
        assert code in (0, LANDED[sig], -signal.SIGTERM), text  # never a failure of its own
        if landed and code == LANDED[sig]:
            return proc.pid, text, tries
    pytest.fail(f"{sig.name} never landed in {len(DELAYS)} runs of {args[0]}")


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    return int(done.stdout)


def tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_killed_builds_leave_nothing_and_rebuild_identically(model_factory, tmp_path):
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.02, seed=i) for i in range(2)]
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: moe\nbase_model: {base}\n"
                          f"experts: [{experts[0]}, {experts[1]}]\nmerge: {{method: dare_ties}}\n")
    work = tmp_path / "builds"
    work.mkdir()
    code, text = finish(start("build", recipe, work / "ref", "-q"))
    assert code == 0, text
    args = ["build", recipe, work / "out", "--force", "-q"]
    rng, stale, log = random.Random(0), [], []
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGKILL):
        # SIGKILL must hit before the rename: while the run's temporary directory exists
        pid, text, tries = kill_run(args, sig, lambda p: owned(work, p.pid), rng, 0.8,
                                    hit=lambda p: owned(work, p.pid))
        log.append((sig.name, tries))
        assert all(not p.exists() for p in stale), stale  # swept by this run, killed or not
        stale = owned(work, pid)
        if sig == signal.SIGTERM:  # handled: the process removed its own
            assert leftovers(work) == [], (leftovers(work), text)
        else:
            assert stale, "kill -9 while writing left no temporary directory"
    code, text = finish(start(*args))
    assert code == 0, text
    assert leftovers(work) == [] and sorted(p.name for p in work.iterdir()) == ["out", "ref"]
    assert tree(work / "out") == tree(work / "ref")
    print("build kills (signal, runs until it landed):", log)


def test_killed_finetunes_resume_identically(tiny_moe, train_text, tmp_path):
    args = ["--data", train_text, "--seq-len", "16", "--batch-size", "2", "--steps", "8",
            "--save-every", "1", "--seed", "3", "-q"]
    code, text = finish(start("finetune", tiny_moe, tmp_path / "ref", *args))
    assert code == 0, text
    out, rng, log = tmp_path / "out", random.Random(1), []
    root = Path(f"{out}.checkpoints")

    def newest() -> int:
        steps = [int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit()]
        return max(steps, default=0)

    def under_way(proc) -> bool:  # a checkpoint or a temporary directory of its own
        return newest() > before or bool(owned(tmp_path, proc.pid))

    stale = []
    for sig in (signal.SIGTERM, signal.SIGKILL, signal.SIGTERM):
        before = newest()
        # SIGKILL must hit while the run writes (a checkpoint, or OUT) to leave something
        ready = under_way if sig == signal.SIGTERM else (lambda p: owned(tmp_path, p.pid))
        pid, text, tries = kill_run(["finetune", tiny_moe, out, *args, "--resume", "--force"],
                                    sig, ready, rng, 0.3, hit=ready)
        log.append((sig.name, tries))
        assert all(not p.exists() for p in stale), stale  # swept by this run, killed or not
        stale = owned(tmp_path, pid)
        if sig == signal.SIGTERM:
            assert leftovers(tmp_path) == [], (leftovers(tmp_path), text)
        else:
            assert stale, "kill -9 while writing left no temporary directory"
    code, text = finish(start("finetune", tiny_moe, out, *args, "--resume", "--force"))
    assert code == 0, text
    assert leftovers(tmp_path) == []
    weights = {"model.safetensors", "config.json"}
    assert {k: v for k, v in tree(out).items() if k in weights} == \
        {k: v for k, v in tree(tmp_path / "ref").items() if k in weights}
    print("finetune kills (signal, runs until it landed):", log)


@pytest.mark.parametrize("prefix", [".out.moemerge-tmp-", ".out.moemerge-old-"])
def test_stale_temp_dirs_of_dead_owners_are_swept(tmp_path, prefix):
    from moemerge.io.atomic import atomic_output_dir

    dead = dead_pid()
    stale = tmp_path / f"{prefix}{dead}-abcd"
    alive = tmp_path / f"{prefix}{os.getppid()}-efgh"  # a live process: never touched
    for d in (stale, alive):
        (d / "out").mkdir(parents=True)
    with atomic_output_dir(tmp_path / "out", force=True) as tmp:
        (tmp / "new").write_text("new")
    assert not stale.exists() and alive.exists()


def test_output_set_aside_by_a_killed_install_is_restored(tmp_path):
    """kill -9 between `out -> aside` and `tmp -> out` of a --force install: the next run
    puts the old output back before it starts (its own failure then keeps it)."""
    from moemerge.io.atomic import atomic_output_dir

    dead = dead_pid()
    aside = tmp_path / f".out.moemerge-old-{dead}-abcd"
    (aside / "out").mkdir(parents=True)
    (aside / "out" / "weights").write_text("old")
    with pytest.raises(RuntimeError), atomic_output_dir(tmp_path / "out", force=True):
        raise RuntimeError("this build fails too")
    assert (tmp_path / "out" / "weights").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_next_run_sweeps_first_even_when_it_fails(tmp_path):
    from typer.testing import CliRunner

    from moemerge.cli import app

    dead = dead_pid()
    stale = tmp_path / f".out.moemerge-tmp-{dead}-abcd"
    stale.mkdir()
    recipe = write_recipe(tmp_path / "r.yaml", "kind: merge\nmodels: [./missing, ./gone]\n")
    result = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "out")])
    assert result.exit_code == 1 and "does not exist" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_finetune_sweeps_dead_checkpoint_temp_dirs(tiny_moe, train_text, tmp_path):
    """A `.step-N.tmp-<pid>-*` of a dead finetune is removed at the start of the next (here
    one that then fails on its options), never a live process's."""
    from typer.testing import CliRunner

    from moemerge.cli import app

    root = tmp_path / "out.checkpoints"
    stale, alive = root / f".step-3.tmp-{dead_pid()}-abcd", root / f".step-3.tmp-{os.getppid()}-x"
    for d in (stale, alive):
        d.mkdir(parents=True)
        (d / "state.pt").write_bytes(b"half")
    result = CliRunner().invoke(app, ["finetune", str(tiny_moe), str(tmp_path / "out"), "--data",
                                      str(train_text), "--batch-size", "3", "--grad-accum", "2"])
    assert result.exit_code == 2 and "divisible" in result.output, result.output
    assert not stale.exists() and alive.exists()


def test_export_sweeps_dead_temp_dirs(tiny_moe, tmp_path):
    """The same for `export` (here refused: the model has no curvature to bake)."""
    from typer.testing import CliRunner

    from moemerge.cli import app

    stale = tmp_path / f".out.moemerge-tmp-{dead_pid()}-abcd"
    alive = tmp_path / f".out.moemerge-tmp-{os.getppid()}-efgh"
    for d in (stale, alive):
        d.mkdir()
    result = CliRunner().invoke(app, ["bake", str(tiny_moe), str(tmp_path / "out")])
    # the wrong model kind: exit 1, as in `route` and `inspect --data`
    assert result.exit_code == 1 and "`moemerge bake` takes only merged_experts" \
        in result.output, result.output
    assert not stale.exists() and alive.exists()
