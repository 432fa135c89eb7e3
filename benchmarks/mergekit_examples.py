"""mergekit's own example configs, built by mergekit 0.1.5 and by moemerge, compared.

The configs of mergekit's repository (examples/, docs/moe.md, docs/multimerge.md) kept in
tests/data/mergekit/ with their sources named. Every model a config names becomes a tiny local
Llama of the same depth (40 layers: the examples slice [0, 40); hidden 64; copies of one random
base with independent N(0, 0.02²) noise), every `dtype` float32 (mergekit computes in the
config's dtype, moemerge in float32: compared at float32 both compute the same numbers). Each
config then runs through mergekit (mergekit-yaml, -moe or -multi; mergekit-mega's `out_path`
documents as mergekit-yaml runs in a row) and through `moemerge import-mergekit` + `build`, and
both outputs are loaded by transformers and compared tensor by tensor (max |Δ|). Random methods
(DARE-TIES) and random gates are compared apart from their draws.
Results: benchmarks/results/mergekit_examples.md.

    python benchmarks/mergekit_examples.py [--venv DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from moemerge.api import build
from moemerge.recipe.mergekit import convert_documents, render
from moemerge.toy import make_random_model, train_tokenizer
from moemerge.toy.published import mergekit_example_models

sys.path.insert(0, str(Path(__file__).parent))
from mergekit_parity import ensure_mergekit  # noqa: E402
from stamp import provenance, stamp_line  # noqa: E402

EXAMPLES = Path(__file__).parent.parent / "tests" / "data" / "mergekit"
RESULTS = Path(__file__).parent / "results"
# what is compared apart from the draws
RANDOM = {"moe-upcycle.yml": "random gates: every tensor but the routers",
          "multimerge.yml": "its last stage is DARE-TIES (random masks): the stages before it "
                            "exactly, the output by its cosine with mergekit's"}


def local_models(root: Path):
    """name -> a tiny local checkpoint (one per name)."""
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 50], vocab_size=300)
    base = make_random_model("llama", root / "base", hidden=64, layers=40, heads=2, kv_heads=1,
                             intermediate=128, vocab=512, tokenizer=tokenizer)
    tensors = load_file(base / "model.safetensors")
    made: dict[str, Path] = {}

    def local(name: str) -> Path:
        if name not in made:
            copy = root / f"m{len(made)}"
            copy.mkdir()
            for side in base.iterdir():
                if side.name != "model.safetensors":
                    (copy / side.name).write_bytes(side.read_bytes())
            gen = torch.Generator().manual_seed(len(made) + 1)
            save_file({n: t + 0.02 * torch.randn(t.shape, generator=gen)
                       for n, t in tensors.items()}, copy / "model.safetensors",
                      metadata={"format": "pt"})
            made[name] = copy
        return made[name]

    return local


def as_float32(documents: list[dict]) -> list[dict]:
    return [{**d, "dtype": "float32"} if "dtype" in d else d for d in documents]


def run_mergekit(bin_dir: Path, documents: list[dict], out: Path, work: Path) -> None:
    def run(tool: str, config: str, target: Path, *extra: str) -> None:
        path = work / f"{target.name}.yml"
        path.write_text(config)
        subprocess.run([str(bin_dir / tool), str(path), *(
            [str(target)] if target else []), "--random-seed", "0", "--device", "cpu", *extra],
            check=True, capture_output=True)

    if len(documents) == 1 and ("experts" in documents[0]):
        run("mergekit-moe", yaml.safe_dump(documents[0]), out,
            "--i-understand-this-is-not-useful-without-training")
    elif len(documents) == 1:
        run("mergekit-yaml", yaml.safe_dump(documents[0]), out)
    elif any("out_path" in d for d in documents):  # mergekit-mega: each document to its path
        paths = {d["out_path"]: work / Path(d["out_path"]).name for d in documents}
        for i, document in enumerate(documents):
            text = yaml.safe_dump({k: v for k, v in document.items() if k != "out_path"})
            for path, local in paths.items():
                text = text.replace(path, str(local))
            run("mergekit-yaml", text, out if i == len(documents) - 1 else
                paths[document["out_path"]])
    else:
        path = work / "multi.yml"
        path.write_text(yaml.safe_dump_all(documents))
        subprocess.run([str(bin_dir / "mergekit-multi"), str(path), "--intermediate-dir",
                        str(work / "stages"), "--out-path", str(out), "--random-seed", "0",
                        "--device", "cpu"], check=True, capture_output=True)


def state(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def compare(name: str, mergekit: Path, ours: Path, work: Path) -> dict:
    a, b = state(mergekit), state(ours)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    routers = {k for k in a if k.endswith(("block_sparse_moe.gate.weight", "mlp.gate.weight"))}
    skip = routers if name == "moe-upcycle.yml" else set()
    row = {"max_abs_delta": max((a[k] - b[k]).abs().max().item() for k in a if k not in skip)}
    if name == "multimerge.yml":  # the deterministic stages, then the random one by cosine
        stage = "second-merge"
        sa, sb = state(work / "stages" / stage), state(ours.with_name(ours.name + ".stages")
                                                         / stage)
        row["max_abs_delta"] = max((sa[k] - sb[k]).abs().max().item() for k in sa)
        base = state(work / "base-of-final")
        ta = torch.cat([(a[k] - base[k]).flatten() for k in a])
        tb = torch.cat([(b[k] - base[k]).flatten() for k in a])
        row["cosine"] = torch.nn.functional.cosine_similarity(ta, tb, dim=0).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path,
                        default=Path.home() / ".cache" / "moemerge" / "mergekit-venv")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    bin_dir, version = ensure_mergekit(opts.venv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        local = local_models(root)
        for example in sorted(EXAMPLES.glob("*.yml")):
            start = time.perf_counter()
            documents = as_float32(mergekit_example_models(
                list(yaml.safe_load_all(example.read_text())), local))
            work = root / example.stem
            work.mkdir()
            run_mergekit(bin_dir, documents, work / "mergekit", work)
            if example.name == "multimerge.yml":  # the final stage's base, for task vectors
                final = documents[-1]
                (work / "base-of-final").symlink_to(final["base_model"])
            recipe = work / "recipe.yaml"
            recipe.write_text(render(convert_documents(documents, example.name), example.name))
            build(recipe, work / "moemerge", progress=False, force=True, verify="structure")
            row = {"example": example.name, **compare(example.name, work / "mergekit",
                                                       work / "moemerge", work),
                   "note": RANDOM.get(example.name, ""),
                   "seconds": round(time.perf_counter() - start, 1)}
            rows.append(row)
            print(row, flush=True)
    meta = {"provenance": provenance(), "mergekit": version}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mergekit_examples.json").write_text(json.dumps({**meta, "rows": rows},
                                                               indent=2) + "\n")
    lines = ["# mergekit's example configs, built by mergekit and by moemerge", "",
             stamp_line(meta["provenance"])[:-1] + f"; mergekit {version}.", "",
             "`python benchmarks/mergekit_examples.py` (the module docstring says how). "
             "max |Δ|: over every tensor of the two outputs as transformers loads them, "
             "float32.", "", "| config | max \\|Δ\\| | compared | seconds |",
             "|---|---:|---|---:|"]
    for row in rows:
        what = row["note"] or "every tensor"
        if "cosine" in row:
            what += f" (cosine {row['cosine']:.3f})"
        lines.append(f"| `{row['example']}` | {row['max_abs_delta']:.3g} | {what} | "
                     f"{row['seconds']:g} |")
    (RESULTS / "mergekit_examples.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
