"""Item 11: kill -9 or SIGTERM at random points of a build and of a finetune (fixed seed,
several times). SIGTERM removes its temporary directory itself (exit 143); what kill -9 leaves
is removed by the next run for the same output, whose result is byte-identical to an
uninterrupted run's."""

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
KILLS = [signal.SIGKILL, signal.SIGTERM, signal.SIGKILL, signal.SIGTERM]
# done; SIGTERM handled (143); killed by SIGKILL; SIGTERM after the command had finished, while
# the interpreter shut down (the default action: nothing is left to clean up then)
EXIT_CODES = (0, 143, -signal.SIGKILL, -signal.SIGTERM)


def start(*args):
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-m", "moemerge", *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc):
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out + err


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.rglob("*") if ".tmp-" in p.name or "moemerge-" in p.name)


def kill_when(proc, ready, rng, spread):
    """Wait until `ready()` (the work is under way), then kill at a random point of the next
    `spread` seconds. Returns the signal sent, or None when the run ended first."""
    sig = KILLS[rng.randrange(len(KILLS))]
    while proc.poll() is None and not ready():
        time.sleep(0.005)
    time.sleep(rng.uniform(0, spread))
    if proc.poll() is not None:
        return None
    proc.send_signal(sig)
    return sig


def files(directory: Path, names=None) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if p.is_file() and (names is None or p.name in names)}


def test_killed_builds_leave_nothing_and_rebuild_identically(model_factory, tmp_path):
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.02, seed=i) for i in range(2)]
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: moe\nbase_model: {base}\n"
                          f"experts: [{experts[0]}, {experts[1]}]\nmerge: {{method: dare_ties}}\n")
    work = tmp_path / "builds"
    work.mkdir()
    code, text = finish(start("build", recipe, work / "ref", "-q"))
    assert code == 0, text
    rng, outcomes = random.Random(0), []
    for _ in range(4):
        proc = start("build", recipe, work / "out", "--force", "-q")
        sig = kill_when(proc, lambda: any(".out.moemerge-tmp-" in p.name
                                          for p in work.iterdir()), rng, 0.8)
        code, text = finish(proc)
        outcomes.append((sig, code))
        if sig == signal.SIGTERM:  # handled: cleaned up by the process itself
            assert leftovers(work) == [], (leftovers(work), text)
        assert code in EXIT_CODES, text
    code, text = finish(start("build", recipe, work / "out", "--force", "-q"))
    assert code == 0, text
    assert leftovers(work) == [] and sorted(p.name for p in work.iterdir()) == ["out", "ref"]
    assert files(work / "out") == files(work / "ref")
    print("build kills (signal, exit code):", outcomes)


def test_killed_finetunes_resume_identically(tiny_moe, train_text, tmp_path):
    args = ["--data", train_text, "--seq-len", "16", "--batch-size", "2", "--steps", "8",
            "--save-every", "1", "--seed", "3", "-q"]
    code, text = finish(start("finetune", tiny_moe, tmp_path / "ref", *args))
    assert code == 0, text
    out, rng, outcomes = tmp_path / "out", random.Random(1), []
    root = Path(f"{out}.checkpoints")
    for _ in range(3):
        proc = start("finetune", tiny_moe, out, *args, "--resume", "--force")
        sig = kill_when(proc, lambda: root.is_dir() and any(root.iterdir()), rng, 1.5)
        code, text = finish(proc)
        outcomes.append((sig, code))
        assert code in EXIT_CODES, text
        if sig == signal.SIGTERM:
            assert leftovers(tmp_path) == [], (leftovers(tmp_path), text)
    code, text = finish(start("finetune", tiny_moe, out, *args, "--resume", "--force"))
    assert code == 0, text
    assert leftovers(tmp_path) == []
    weights = {"model.safetensors", "config.json"}
    assert files(out, weights) == files(tmp_path / "ref", weights)
    print("finetune kills (signal, exit code):", outcomes)


@pytest.mark.parametrize("prefix", [".out.moemerge-tmp-", ".out.moemerge-old-"])
def test_stale_temp_dirs_of_dead_owners_are_swept(tmp_path, prefix):
    from moemerge.io.atomic import atomic_output_dir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
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

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
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

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f".out.moemerge-tmp-{dead}-abcd"
    stale.mkdir()
    recipe = write_recipe(tmp_path / "r.yaml", "kind: merge\nmodels: [./missing, ./gone]\n")
    result = CliRunner().invoke(app, ["build", str(recipe), str(tmp_path / "out")])
    assert result.exit_code == 1 and "does not exist" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]
