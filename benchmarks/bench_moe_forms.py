"""What reading an MoE in transformers 5's fused form costs against the classic form: the same
random Mixtral saved both ways (classic by `save_pretrained`, fused as its state dict, as
mergekit 0.1.5 writes it), then each command run in its own process on each form, timed (the
fastest of --repeats) with the process's peak RSS (wait4):

- `extract --expert 3`: one expert as a dense model (reads 1/E of each stack);
- `build --verify structure` of `kind: merge` (average) of the MoE with a perturbed copy of
  it, output classic, and the same with `output.experts: fused` (no load check: the peak is
  the merge's own; extract loads its output in transformers, which sets its peak).

A fused stack is read per expert as a byte range of the file, so reading the fused form should
cost what reading the classic form does; the line under the table gives the size of one
layer's stacks, what a reader that loaded whole stacks would hold at least.
Results: benchmarks/results/moe-forms.md.

    python benchmarks/bench_moe_forms.py [--hidden 512] [--layers 4] [--experts 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stamp import provenance, stamp_line

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MOEMERGE = [sys.executable, "-m", "moemerge"]


def make(root: Path, hidden: int, layers: int, experts: int) -> None:
    """One random Mixtral in each form, and another (for merging), under `root`: run in a
    child process, so that this one never holds torch (a child's peak RSS starts at its
    parent's, copied at fork)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.MixtralConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        num_local_experts=experts, num_experts_per_tok=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    for copy in ("", "-tuned"):
        model = transformers.MixtralForCausalLM(config).eval()
        classic, fused = root / f"classic{copy}", root / f"fused{copy}"
        model.save_pretrained(classic)
        fused.mkdir()
        model.config.architectures = ["MixtralForCausalLM"]
        model.config.save_pretrained(fused)
        save_file({n: t.contiguous() for n, t in model.state_dict().items()},
                  fused / "model.safetensors", metadata={"format": "pt"})


def run(args: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of one child process."""
    start = time.perf_counter()
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{' '.join(map(str, args))} failed: {child.stderr.read().decode()}")
    return seconds, usage.ru_maxrss / 1024


def best(args: list[str], repeats: int, out: Path) -> tuple[float, float]:
    results = []
    for _ in range(repeats):
        subprocess.run(["rm", "-rf", str(out)], check=True)
        results.append(run(args))
    return min(r[0] for r in results), max(r[1] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)  # (the child's job)
    opts = parser.parse_args()
    if opts.make:
        return make(opts.make, opts.hidden, opts.layers, opts.experts)
    record = provenance()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        subprocess.run([sys.executable, __file__, "--make", str(root), "--hidden",
                        str(opts.hidden), "--layers", str(opts.layers), "--experts",
                        str(opts.experts)], check=True)
        dirs = {name: root / name for name in ("classic", "fused", "classic-tuned",
                                               "fused-tuned")}
        size = sum(f.stat().st_size for f in dirs["fused"].glob("*.safetensors")) / 2**20
        stack = 3 * opts.experts * opts.hidden * (opts.hidden * 11 // 4) * 4 / 2**20
        for form in ("classic", "fused"):
            out = root / "out"
            extract = best([*MOEMERGE, "extract", str(dirs[form]), str(out), "--expert", "3"],
                           opts.repeats, out)
            rows.append((f"extract --expert 3 ({form} input)", *extract))
            for stored in ("classic", "fused"):
                recipe = root / f"merge-{form}-{stored}.yaml"
                recipe.write_text(f"kind: merge\nmodels: [{dirs[form]}, {dirs[form + '-tuned']}]"
                                  f"\nmerge: {{method: average}}\n"
                                  f"output: {{experts: {stored}}}\n")
                merged = best([*MOEMERGE, "build", str(recipe), str(out), "-q", "--verify",
                               "structure"], opts.repeats, out)
                rows.append((f"merge of two MoEs ({form} inputs, {stored} output)", *merged))
    lines = ["# Reading the fused form (transformers 5's stacks) against the classic form", "",
             stamp_line(record), "",
             f"A random Mixtral, hidden {opts.hidden}, {opts.layers} layers, {opts.experts} "
             f"experts: {size:.0f} MiB per checkpoint. Each row the fastest of {opts.repeats} "
             "runs in a fresh process (import of torch and transformers included), with its "
             "peak RSS.", "",
             "| command | seconds | peak RSS (MiB) |", "|---|---:|---:|"]
    lines += [f"| {name} | {seconds:.2f} | {rss:.0f} |" for name, seconds, rss in rows]
    lines += ["", f"One layer's three expert stacks hold {stack:.0f} MiB. Reading the fused form "
              "costs what reading the classic form does (each expert is read as its own byte "
              "range of its stack); writing it holds whole stacks, the output's tensors, "
              "several at once with the build's --lookahead (default 3), where a classic "
              "output holds single experts.",
              "", "    python benchmarks/bench_moe_forms.py " + " ".join(sys.argv[1:]), ""]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe-forms.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
