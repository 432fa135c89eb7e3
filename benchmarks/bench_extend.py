"""What `moemerge extend` saves: a calibrated token-routed MoE of two experts grown by a third,
timed three ways in one process (transformers imported once, before any timing), each the
fastest of --repeats runs:

- extend (fast): routers refitted from the stored statistics plus the new expert's text;
- extend --recalibrate: every router calibrated again on all the text (exact);
- a from-scratch `moemerge build` of the recipe copy extend writes (the baseline).

Models: Llama, random weights, three perturbed experts (FFN only), three planted domains in
disjoint alphabets (as tests/integration/test_extend.py), one shape per --shapes entry
`hidden x layers`. Results: benchmarks/results/extend.md, as ratios to the rebuild.

    python benchmarks/bench_extend.py [--shapes 32x2,256x8] [--tokens 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

from stamp import provenance, stamp_line

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ALPHABETS = {"letters": "abcdefghijklm", "digits": "0123456789+-*", "marks": "!#$%&()[]{}<>"}


def planted_text(alphabet: str, seed: int, words: int = 1500) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6)))
                    for _ in range(words))


def make_models(root: Path, hidden: int, layers: int) -> tuple[Path, dict[str, Path]]:
    """(base, {domain: expert}): a random Llama and three copies with FFN noise."""
    import torch
    from safetensors.torch import load_file, save_file

    from moemerge.toy.tokenizer import train_tokenizer
    from moemerge.toy.train import make_random_model

    tokenizer = train_tokenizer([" ".join(ALPHABETS.values()) * 50], vocab_size=300)
    base = make_random_model("llama", root / "base", hidden=hidden, layers=layers,
                             heads=4, kv_heads=2, intermediate=2 * hidden, vocab=300,
                             tokenizer=tokenizer)
    experts = {}
    for seed, domain in enumerate(ALPHABETS):
        experts[domain] = shutil.copytree(base, root / domain)
        gen = torch.Generator().manual_seed(seed)
        for file in experts[domain].glob("*.safetensors"):
            tensors = {name: t + 0.05 * torch.randn(t.shape, generator=gen) if "mlp" in name
                       else t for name, t in load_file(file).items()}
            save_file(tensors, file, metadata={"format": "pt"})
        (root / f"{domain}.txt").write_text(planted_text(ALPHABETS[domain], seed))
    return base, experts


def fastest(repeats: int, run, out: Path) -> float:
    times = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(root: Path, hidden: int, layers: int, tokens: int, repeats: int) -> dict:
    from moemerge.api import build
    from moemerge.built.extend.command import extend_moe
    from moemerge.io.atomic import RECIPE_COPY

    base, experts = make_models(root, hidden, layers)
    data = ", ".join(f"{d}={root}/{d}.txt" for d in ("letters", "digits"))
    (root / "two.yaml").write_text(
        f"kind: moe\nbase_model: {base}\nexperts_per_token: 1\nexperts:\n"
        + "".join(f"  - {{model: {experts[d]}, name: {d}}}\n" for d in ("letters", "digits"))
        + f"calibration: {{data: [{data}], max_tokens: {tokens}, seq_len: 32}}\n")
    build(root / "two.yaml", root / "two", progress=False)

    def extend(recalibrate: bool) -> None:
        extend_moe(root / "two", root / "three", [experts["marks"]], names=["marks"],
                   calibration=[f"marks={root}/marks.txt"], keep_shared=True,
                   recalibrate=recalibrate, force=True)

    fast = fastest(repeats, lambda: extend(False), root / "three")
    exact = fastest(repeats, lambda: extend(True), root / "three")
    shutil.copy(root / "three" / RECIPE_COPY, root / "three.yaml")
    rebuild = fastest(repeats, lambda: build(root / "three.yaml", root / "rebuilt",
                                             progress=False), root / "rebuilt")
    return {"shape": f"hidden {hidden}, {layers} layers", "fast": fast, "exact": exact,
            "rebuild": rebuild}


def table(rows: list[dict], tokens: int, repeats: int) -> str:
    lines = [f"| model (Llama, 3 experts, {tokens} calibration tokens per domain) | extend | "
             "extend --recalibrate | rebuild | extend / rebuild | --recalibrate / rebuild |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['fast']:.2f} s | {r['exact']:.2f} s | {r['rebuild']:.2f} s "
              f"| {r['fast'] / r['rebuild']:.2f} | {r['exact'] / r['rebuild']:.2f} |"
              for r in rows]
    return "\n".join(lines) + f"\n\nFastest of {repeats} runs each, in one process.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32x2,256x8", help="hidden x layers, comma-separated")
    parser.add_argument("--tokens", type=int, default=1024, help="calibration.max_tokens")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import transformers  # noqa: F401  (imported before any timing)

    rows = []
    for shape in args.shapes.split(","):
        hidden, layers = (int(n) for n in shape.split("x"))
        with tempfile.TemporaryDirectory(prefix="bench-extend-") as root:
            rows.append(measure(Path(root), hidden, layers, args.tokens, args.repeats))
        print(table(rows[-1:], args.tokens, args.repeats))
    text = table(rows, args.tokens, args.repeats)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "extend.md").write_text(
        f"# moemerge extend: time against a rebuild\n\n{stamp_line(provenance())}\n\n"
        f"`python benchmarks/bench_extend.py --shapes {args.shapes} --tokens {args.tokens} "
        f"--repeats {args.repeats}`\n\n{text}")
    print(f"wrote {RESULTS / 'extend.md'}")


if __name__ == "__main__":
    main()
