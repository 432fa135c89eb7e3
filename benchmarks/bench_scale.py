"""Builds at real shapes: moemerge against the I/O floor and mergekit, measured in one run.

    python benchmarks/bench_scale.py [--shape llama-3.2-1b] [--experts 4] [--layers N]
        [--mergekit /tmp/mk/bin] [--cache /tmp/moemerge-scale] [--runs dense:average,...]
        [--inspect]

Inputs: benchmarks/shapes.py (1 base + `--experts` experts, bf16, real shapes). Each run is a
fresh process, once (a 1B build takes tens of seconds; the machine is shared, so every row is
measured in the same session as its floor):

  io_floor:<kind>:<reads>[:cold]
                          read every input byte the method needs (average: the experts; the
                          others: base + experts; os.readv, 16 MiB blocks) and write as many
                          bytes as that kind's output, then fsync (moemerge fsyncs its
                          shards; mergekit does not); warm: the fastest of 3
  moemerge:<kind>:<m>     `moemerge.api.build` in a fresh interpreter: `build s` is the build
                          after the imports (compare with the floor), `command s` the whole
                          process, start-up included (compare with mergekit)
  mergekit:<kind>:<m>     mergekit-yaml / mergekit-moe, whole command, with its fastest CPU
                          options (-j 2 --async-write --lazy-unpickle, float32 arithmetic,
                          bf16 output as moemerge's)
  moemerge:inspect        `moemerge inspect BASE EXPERT...`, whole command
  select                  the TIES threshold (k-th largest |τ|, density 0.5) of one random
                          |τ| of the largest tensor's size (TIES finds one per expert):
                          kthvalue (moemerge's), topk, and a two-pass histogram select
                          (bincount of the top 16 bits, then kthvalue inside one bucket); all
                          exact, checked equal

Peak RSS: VmHWM of the build process (moemerge) or ru_maxrss of the waited-for command
(mergekit). Bytes read/written: the process's rchar/wchar from /proc (syscall bytes: pages a
tool maps instead of reading do not show, so mergekit's reads through mmap are not counted
there), and the output directory's size. Warm: every input was read once just before (the
page cache holds them if memory allows); cold: after `echo 3 > /proc/sys/vm/drop_caches`,
when this process may write it. Results: benchmarks/results/scale.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from stamp import provenance, stamp_line

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RUNS = ("dense:average", "dense:task_arithmetic", "moe:average")  # TIES: --runs, see --help
ALL_RUNS = ("dense:average", "dense:task_arithmetic", "dense:ties", "dense:dare_ties",
            "dense:dare_ties_l1", "moe:average", "moe:base", "moe:ties")
# dare_ties_l1: moemerge's dare_ties with mergekit's L1 rescale (what import-mergekit writes);
# mergekit's dare_ties rescales by L1 itself
MERGEKIT_METHOD = {"average": "linear", "task_arithmetic": "task_arithmetic", "ties": "ties",
                   "dare_ties": "dare_ties", "dare_ties_l1": "dare_ties"}
FLOOR_REPEATS = 3  # the floor is cheap and noisy (fsync): its fastest of 3
MERGEKIT_FAST = ["-j", "2", "--async-write", "--lazy-unpickle", "--quiet"]
CHILD = r"""
import json, os, resource, subprocess, sys, time
mode, args = sys.argv[1], json.loads(sys.argv[2])

def io():
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])

def hwm():
    return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024

t0 = time.perf_counter()
result = {}
if mode == "idle":
    import moemerge.api  # noqa: F401
    result["startup_seconds"] = time.perf_counter() - t0
elif mode == "io_floor":
    block = bytearray(1 << 24)
    r0, w0 = io()
    for path in args["inputs"]:
        fd = os.open(path, os.O_RDONLY)
        while os.readv(fd, [block]):
            pass
        os.close(fd)
    fd = os.open(args["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = args["out_bytes"]
    while left > 0:
        left -= os.write(fd, memoryview(block)[: min(left, len(block))])
    os.fsync(fd)
    os.close(fd)
    r1, w1 = io()
    result |= {"read_bytes": r1 - r0, "written_bytes": w1 - w0}
elif mode == "moemerge":
    from moemerge.api import build
    result["startup_seconds"] = time.perf_counter() - t0
    r0, w0 = io()
    u0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    build(args["recipe"], args["out"], progress=False, verify="structure",
          workers=args.get("workers", 1), device=args.get("device", "cpu"))
    r1, w1 = io()
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    result |= {"read_bytes": r1 - r0, "written_bytes": w1 - w0,
               "user_s": u1.ru_utime - u0.ru_utime, "sys_s": u1.ru_stime - u0.ru_stime,
               "minor_faults": u1.ru_minflt - u0.ru_minflt}
elif mode == "compute":  # the merge arithmetic alone, inputs already in memory, no I/O
    import torch
    try:
        from moemerge.merge.dispatch import merge
    except ImportError:  # before the method registry
        from moemerge.merge.methods import merge
    for method in args["methods"]:
        spent = 0.0
        for shape, count in args["shapes"]:
            gen = torch.Generator().manual_seed(0)
            tensors = [torch.empty(shape, dtype=torch.bfloat16) for _ in range(args["n"])]
            base = torch.empty(shape, dtype=torch.bfloat16)
            for t in (base, *tensors):
                t.copy_(torch.randn(shape, generator=gen))
            t1 = time.perf_counter()
            params = {"density": 0.5} if "ties" in method else {}
            merge(method, base=base, tensors=tensors, generator=gen, dtype=torch.bfloat16,
                  **params)
            spent += (time.perf_counter() - t1) * count
            del tensors, base
        result[f"{method}_merge_s"] = round(spent, 1)
elif mode == "select":  # the TIES threshold of a [n, numel] |τ| stack, three exact ways
    import torch
    torch.manual_seed(0)
    flat = torch.randn(args["n"], args["numel"]).abs_()
    k = int(args["numel"] * args["density"])
    def kthvalue():
        return flat.kthvalue(flat.shape[1] - k + 1, dim=1).values
    def topk():
        return flat.topk(k, dim=1, sorted=False).values.min(dim=1).values
    def histogram():  # pass 1: counts of the top 16 bits; pass 2: kthvalue inside one bucket
        out = []
        for row in flat:
            high = (row.view(torch.int32) >> 16).long()  # |x| >= 0: int order = float order
            above = torch.bincount(high, minlength=1 << 15).flip(0).cumsum(0).flip(0)
            b = int((above >= k).nonzero().max())
            rank = k - (int(above[b + 1]) if b + 1 < above.numel() else 0)
            inside = row[high == b]
            out.append(inside.kthvalue(inside.numel() - rank + 1).values)
        return torch.stack(out)
    found = {}
    for name, fn in (("kthvalue", kthvalue), ("topk", topk), ("histogram", histogram)):
        t1 = time.perf_counter()
        found[name] = fn()
        result[f"{name}_s"] = round(time.perf_counter() - t1, 2)
    result["equal"] = all(torch.equal(found["kthvalue"], v) for v in found.values())
else:  # an external command; poll its /proc/<pid>/io, peak RSS from wait4
    proc = subprocess.Popen(args["cmd"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    last = (0, 0)
    while proc.poll() is None:
        try:
            fields = dict(l.split(": ") for l in open(f"/proc/{proc.pid}/io").read().splitlines())
            last = (int(fields["rchar"]), int(fields["wchar"]))
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    if proc.returncode:
        sys.stderr.write(proc.stderr.read().decode()[-3000:])
        sys.exit(1)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    result |= {"read_bytes": last[0], "written_bytes": last[1], "user_s": used.ru_utime,
               "sys_s": used.ru_stime, "minor_faults": used.ru_minflt}
result["seconds"] = time.perf_counter() - t0
result["peak_rss_mib"] = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
                          if mode == "cmd" else hwm())
print(json.dumps(result))
"""


def child(mode: str, *, check: bool = True, **args) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, mode, json.dumps(args)],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(
                              HERE.parent)})
    if done.returncode != 0:
        if not check:  # recorded, not fatal: the other rows of the run still count
            return {"error": done.stderr.strip().splitlines()[-1:] or ["failed"]}
        raise SystemExit(f"{mode} {args} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["command_seconds"] = time.perf_counter() - t0
    return result


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def weight_files(model: str) -> list[str]:
    return sorted(str(f) for f in Path(model).glob("*.safetensors"))


def warm(files: list[str]) -> None:
    block = bytearray(1 << 24)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        while os.readv(fd, [block]):
            pass
        os.close(fd)


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def moemerge_recipe(root: Path, base: str, experts: list[str], kind: str, method: str) -> Path:
    path = root / f"moemerge-{kind}-{method}.yaml"
    listed = "".join(f"\n  - {e}" for e in experts)
    if kind == "dense":
        params = {"average": "", "task_arithmetic": ", lambda: 1.0",
                  "dare_ties_l1": ", density: 0.5, lambda: 1.0, rescale: l1"}.get(
            method, ", density: 0.5, lambda: 1.0")  # a method takes only its own parameters
        path.write_text(f"kind: merge\nbase_model: {base}\nmodels:{listed}\n"
                        f"merge: {{method: {method.removesuffix('_l1')}{params}}}\n")
    else:
        path.write_text(f"kind: moe\nassembly: token_routed\nbase_model: {base}\n"
                        f"experts:{listed}\nexperts_per_token: 2\nmerge: {{method: {method}}}\n")
    return path


def mergekit_recipe(root: Path, base: str, experts: list[str], kind: str, method: str) -> Path:
    path = root / f"mergekit-{kind}-{method}.yaml"
    if kind == "dense":
        mk = MERGEKIT_METHOD[method]
        params = "weight: 1.0" + (", density: 0.5" if "ties" in method else "")
        entries = "".join(f"\n  - model: {m}\n    parameters: {{{params}}}" for m in experts)
        norm = "normalize: true" if method == "average" else "normalize: false"
        based = "" if method == "average" else f"base_model: {base}\n"
        path.write_text(f"merge_method: {mk}\n{based}models:{entries}\n"
                        f"parameters: {{{norm}}}\ndtype: float32\nout_dtype: bfloat16\n")
    else:  # mergekit-moe copies the base's non-FFN tensors; random gates, no forward passes
        entries = "".join(f"\n  - source_model: {m}\n    positive_prompts: ['x']"
                          for m in experts)
        path.write_text(f"base_model: {base}\ngate_mode: random\ndtype: bfloat16\n"
                        f"experts_per_token: 2\nexperts:{entries}\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="llama-3.2-1b")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/moemerge-scale"))
    parser.add_argument("--mergekit", type=Path, help="bin/ holding mergekit-yaml, mergekit-moe")
    parser.add_argument("--runs", default=",".join(RUNS), help="KIND:METHOD,... of "
                        f"{', '.join(ALL_RUNS)}")
    parser.add_argument("--inspect", action="store_true")
    parser.add_argument("--compute", default="", help="methods (comma-separated) whose merge "
                        "arithmetic alone to time: random bf16 inputs in memory, every tensor "
                        "shape of the model, no I/O")
    parser.add_argument("--no-select", action="store_true", help="skip timing the TIES "
                        "threshold (kthvalue, topk, histogram) on the largest tensor")
    parser.add_argument("--cold", action="store_true", help="also a cold-cache floor and "
                        "moemerge dense average (needs write access to drop_caches)")
    parser.add_argument("--device", default="cpu", help="where moemerge's merge arithmetic "
                        "runs (build --device): cpu, or cuda on a GPU machine")
    parser.add_argument("--workers", type=int, default=1, help="build --workers")
    parser.add_argument("--tag", help="results key (default: shape[-layers])")
    opts = parser.parse_args()

    sys.path.insert(0, str(HERE))
    from shapes import make_shape_set

    t0 = time.perf_counter()
    made = make_shape_set(opts.shape, opts.experts, layers=opts.layers, cache=opts.cache)
    base, experts = made["base"], made["experts"]
    inputs = [f for m in [base, *experts] for f in weight_files(m)]
    work = opts.cache / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    runs: dict[str, dict] = {"idle": child("idle")}
    print(f"inputs ready ({time.perf_counter() - t0:.0f} s): {made['made']}", flush=True)
    wanted = [r.split(":") for r in opts.runs.split(",") if r]
    out_bytes: dict[str, int] = {}
    for kind, method in wanted:
        out = work / f"out-{kind}-{method}"
        warm(inputs)
        recipe = moemerge_recipe(work, base, experts, kind, method)
        r = child("moemerge", recipe=str(recipe), out=str(out), workers=opts.workers,
                  device=opts.device)
        r["out_bytes"] = dir_bytes(out)
        out_bytes.setdefault(kind, sum(Path(f).stat().st_size for f in out.glob("*.safetensors")))
        shutil.rmtree(out)
        runs[f"moemerge:{kind}:{method}"] = r
        print(kind, method, r, flush=True)
        reads = "experts" if method == "average" else "all"  # average never reads the base
        floor = f"io_floor:{kind}:{reads}"
        if floor not in runs:
            files = [f for m in experts for f in weight_files(m)] if reads == "experts" \
                else inputs
            tries = []
            for _ in range(FLOOR_REPEATS):
                warm(inputs)
                tries.append(child("io_floor", inputs=files, out=str(work / "floor"),
                                   out_bytes=out_bytes[kind]))
                (work / "floor").unlink()
            runs[floor] = min(tries, key=lambda t: t["seconds"])
            print(floor, runs[floor], flush=True)
            if opts.cold and drop_caches():
                runs[f"{floor}:cold"] = child("io_floor", inputs=files, out=str(work / "floor"),
                                              out_bytes=out_bytes[kind])
                (work / "floor").unlink()
                drop_caches()
                r = child("moemerge", recipe=str(recipe), out=str(out))
                shutil.rmtree(out)
                runs[f"moemerge:{kind}:{method}:cold"] = r
                print("cold", kind, runs[f"{floor}:cold"], r, flush=True)
        # one mergekit run per mergekit recipe (dare_ties_l1's is dare_ties')
        done_as = next((k for k in runs if kind == "dense" and k.startswith("mergekit:dense:")
                        and MERGEKIT_METHOD[k.split(":")[2]] == MERGEKIT_METHOD[method]), None)
        if done_as is not None:
            runs[f"mergekit:{kind}:{method}"] = runs[done_as]
        elif opts.mergekit is not None and (kind == "dense" or method in ("average", "base")):
            tool = "mergekit-yaml" if kind == "dense" else "mergekit-moe"
            cmd = [str(opts.mergekit / tool), str(mergekit_recipe(work, base, experts, kind,
                                                                  method)), str(out),
                   *MERGEKIT_FAST, *(["--no-copy-tokenizer"] if kind == "dense" else [])]
            warm(inputs)
            r = child("cmd", cmd=cmd, check=False)
            if "error" not in r:
                r["out_bytes"] = dir_bytes(out)
            shutil.rmtree(out, ignore_errors=True)
            runs[f"mergekit:{kind}:{method}"] = r
            print("mergekit", kind, method, r, flush=True)
    if opts.compute:
        from collections import Counter

        from shapes import tensor_list
        config = json.loads((Path(base) / "config.json").read_text())
        shapes = Counter(tuple(s) for _, s in tensor_list(config))
        runs["compute"] = child("compute", n=opts.experts, methods=opts.compute.split(","),
                                shapes=[[list(s), c] for s, c in shapes.items()])
        print("compute", runs["compute"], flush=True)
    if not opts.no_select:
        runs["select"] = child("select", n=1, numel=made["made"]["largest_tensor_bytes"]
                               // 2, density=0.5)
        print("select", runs["select"], flush=True)
    if opts.inspect:
        warm(inputs)
        runs["moemerge:inspect"] = child("cmd", cmd=[sys.executable, "-m", "moemerge",
                                                     "inspect", base, *experts])
        print("inspect", runs["moemerge:inspect"], flush=True)
    shutil.rmtree(work, ignore_errors=True)
    report(opts, runs, made)


def report(opts, runs: dict, made: dict) -> None:
    idle = runs.pop("idle")
    select = runs.pop("select", None)
    compute = runs.pop("compute", None)
    info = made["made"]
    tag = opts.tag or (f"{opts.shape}-{opts.layers}L" if opts.layers else opts.shape)
    rows = []
    errors = {name: r.pop("error") for name, r in list(runs.items()) if "error" in r}
    runs = {name: r for name, r in runs.items() if name not in errors}
    listed: set[int] = set()
    for name, r in runs.items():
        if id(r) in listed:  # a mergekit run shared by two moemerge rows: its row once
            continue
        listed.add(id(r))
        tool, kind, *rest = name.split(":") + [""]
        cold = name.endswith(":cold")
        reads = "experts" if rest[0] == "average" else "all"
        floor = runs.get(f"io_floor:{kind}:{reads}" + (":cold" if cold else ""))
        mk = runs.get(f"mergekit:{kind}:{rest[0]}") if tool == "moemerge" and not cold else None
        build_s = r["seconds"]
        command_s = r["command_seconds"] if tool != "io_floor" else r["seconds"]
        rows.append({
            "run": name,
            "build_s": round(build_s, 1),
            "command_s": round(command_s, 1),
            "x_floor": round(build_s / floor["seconds"], 2) if floor and tool != "io_floor"
            else None,
            "x_mergekit_time": round(command_s / mk["command_seconds"], 2) if mk else None,
            "peak_rss_mib": round(r["peak_rss_mib"]),
            "x_mergekit_rss": round(r["peak_rss_mib"] / mk["peak_rss_mib"], 2) if mk else None,
            "read_gb": round(r["read_bytes"] / 1e9, 2) if "read_bytes" in r else None,
            "written_gb": round(r["written_bytes"] / 1e9, 2) if "written_bytes" in r else None,
            "out_gb": round(r["out_bytes"] / 1e9, 2) if "out_bytes" in r else None,
            "user_sys_s": f"{r['user_s']:.1f} / {r['sys_s']:.1f}" if "user_s" in r else None,
            "minor_faults_m": round(r["minor_faults"] / 1e6, 2) if "minor_faults" in r
            else None,
        })
    stamp = provenance()
    meta = {
        "device": opts.device, "workers": opts.workers,
        # TIES-family merges: the compiled kernel (merge/native) unless MOEMERGE_NATIVE=0
        "native_kernel": os.environ.get("MOEMERGE_NATIVE", "1") != "0",
        "mergekit": mergekit_version(opts.mergekit),
        "inputs": f"{tag}: 1 base + {opts.experts} experts, {info['params'] / 1e9:.2f}B params "
                  f"each, {info['model_bytes'] / 1e9:.2f} GB bf16 in {info['shards']} shard(s), "
                  f"largest tensor {info['largest_tensor_bytes'] / 2**20:.0f} MiB",
        "generation_seconds": info["seconds"],
        "moemerge_startup_s": round(idle["startup_seconds"], 1),
        "failed": errors or None,
        "moemerge_idle_rss_mib": round(idle["peak_rss_mib"]),
        "merge_arithmetic_only": compute and {k: v for k, v in compute.items()
                                              if k.endswith("_merge_s")},
        "ties_threshold_on_largest": select and {k: v for k, v in select.items()
                                                 if k.endswith("_s") or k == "equal"},
    }
    RESULTS.mkdir(exist_ok=True)
    file = RESULTS / "scale.json"
    everything = json.loads(file.read_text()) if file.is_file() else {}
    everything[tag] = {"provenance": stamp, "meta": meta, "runs": rows}
    file.write_text(json.dumps(everything, indent=2) + "\n")
    lines = ["| run | build s | command s | × I/O floor | × mergekit time | peak RSS MiB | "
             "× mergekit RSS | read GB | written GB | output GB | user / sys s | minor faults M |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join("–" if v is None else str(v) for v in row.values()) + " |"
              for row in rows]
    table = "\n".join(lines)
    (RESULTS / f"scale-{tag}.md").write_text(
        f"## {tag}\n\n{stamp_line(stamp)}\n\n" + "; ".join(f"{k}: {v}" for k, v in meta.items())
        + "\n\n" + table + "\n")
    print(table)


def mergekit_version(bin_dir: Path | None) -> str | None:
    if bin_dir is None:
        return None
    done = subprocess.run([str(bin_dir / "python"), "-c", "import importlib.metadata as m;"
                           "print(m.version('mergekit'))"], capture_output=True, text=True)
    return done.stdout.strip() or None


if __name__ == "__main__":
    main()
