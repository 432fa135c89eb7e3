"""Parity with mergekit: the same merge built by both tools, for every method both have.

Makes a small random Llama base and three noisy copies of it (fine-tune stand-ins), then for
each shared method builds the merge with `moemerge build` (in this process) and with
`mergekit-yaml` (in its own venv, never a dependency of moemerge), and compares every tensor:

  max |Δ| with mergekit's conventions   moemerge with the recipe options that switch to them
  max |Δ| with moemerge's defaults      the same recipe without those options (the difference a
                                        user porting a config would get without them)

Random methods (DARE, DELLA) draw different masks in the two tools, so they are compared on
their statistics over a one-model merge (kept fraction, rescale of the survivors, L1 norm kept;
DELLA: kept fraction in the top and bottom magnitude halves) and, for three models, on the
cosine between the two outputs' task vectors (and, for scale, between two moemerge seeds).
Results: benchmarks/results/mergekit_parity.md.

    python benchmarks/mergekit_parity.py [--venv DIR] [--hidden 128] [--layers 4]

--venv: a venv holding mergekit (default ~/.cache/moemerge/mergekit-venv); made when missing:
`pip install torch==<this torch>` first (so pip keeps the CPU wheel), then the newest mergekit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from moemerge.api import build
from moemerge.toy import make_random_model, train_tokenizer, with_added_tokens

RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).parent))
from parity_cases import CASES, RANDOM_CASES  # noqa: E402
from stamp import provenance  # noqa: E402


def ensure_mergekit(venv: Path) -> tuple[Path, str]:
    """The venv's bin/ and its mergekit version, installing it first when needed."""
    python = venv / "bin" / "python"
    if not (venv / "bin" / "mergekit-yaml").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        version = torch.__version__.split("+")[0]
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={version}"],
                       check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "mergekit"], check=True)
    version = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('mergekit'))"], capture_output=True, text=True,
                             check=True).stdout.strip()
    return venv / "bin", version


def make_models(root: Path, hidden: int, layers: int, family: str = "llama") -> list[Path]:
    """A random base and 3 copies with independent N(0, 0.01²) noise (float32)."""
    root = root / family
    root.mkdir()
    tokenizer = train_tokenizer(["def f(x):\n    return x + 1\n" * 50], vocab_size=300)
    base = make_random_model(family, root / "base", hidden=hidden, layers=layers,
                             heads=hidden // 32, kv_heads=hidden // 64, intermediate=hidden * 2,
                             vocab=512, tokenizer=tokenizer)
    tensors = load_file(base / "model.safetensors")
    paths = [base]
    for i in range(3):
        copy = root / f"m{i}"
        copy.mkdir()
        for side in base.iterdir():
            if side.name != "model.safetensors":
                (copy / side.name).write_bytes(side.read_bytes())
        gen = torch.Generator().manual_seed(100 + i)
        save_file({n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in tensors.items()},
                  copy / "model.safetensors", metadata={"format": "pt"})
        paths.append(copy)
    return paths


def run_moemerge(root: Path, name: str, recipe: str) -> dict[str, torch.Tensor]:
    path = root / f"{name}.moemerge.yaml"
    path.write_text(recipe)
    out = root / f"{name}.moemerge"
    build(path, out, progress=False, force=True, verify="structure")
    return load_file(out / "model.safetensors")


def run_mergekit(root: Path, bin_dir: Path, name: str, config: str) -> dict[str, torch.Tensor]:
    path = root / f"{name}.mergekit.yaml"
    path.write_text(config)
    out = root / f"{name}.mergekit"
    subprocess.run([str(bin_dir / "mergekit-yaml"), str(path), str(out), "--random-seed", "0",
                    "--no-copy-tokenizer", "--quiet", "--write-model-card"], check=True,
                   capture_output=True)
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def max_delta(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def exact_rows(root, bin_dir, model_sets) -> list[dict]:
    rows = []
    for case in CASES:
        models = model_sets(case.family)
        mk = run_mergekit(root, bin_dir, case.name, case.mergekit(models))
        ours = run_moemerge(root, case.name, case.moemerge(models, conventions=True))
        row = {"method": case.name, "mergekit": case.mergekit_method,
               "options": case.options or "–", "max_abs_delta": max_delta(ours, mk)}
        if case.options:
            default = run_moemerge(root, case.name + "-default",
                                   case.moemerge(models, conventions=False))
            row["max_abs_delta_defaults"] = max_delta(default, mk)
        rows.append(row)
        print(f"{case.name:28s} {row['max_abs_delta']:.3g}  "
              f"{row.get('max_abs_delta_defaults', float('nan')):.3g}", flush=True)
    return rows


PROMPTS = [  # expert i's positive prompts (and negative ones for the second), varied lengths
    ["def main(argv):\n    return 0", "for item in items:", "import os"],
    ["Once upon a time", "The river ran past the old mill and into the town."],
    ["2 + 2 = 4", "the integral of x is x squared over two"],
]
NEGATIVE = {1: ["def helper():"]}


def moe_rows(root: Path, bin_dir: Path, models) -> list[dict]:
    """mergekit-moe against the recipe `import-mergekit` makes of its config, per gate mode:
    random (every parameter but the routers: the draws differ), hidden, hidden_avg and
    cheap_embed (every parameter, the routers too), compared as loaded by transformers (the
    two tools write different tensor names for the same model)."""
    return [*(moe_row(root, bin_dir, models, gate)
              for gate in ("random", "hidden", "hidden_avg", "cheap_embed")),
            shared_row(root, bin_dir, models, "deepseek", None),
            shared_row(root, bin_dir, models, "qwen", ["a helpful answer", "In general,"])]


def both_moe(root: Path, bin_dir: Path, name: str, config: str):
    """mergekit-moe's build of `config` to root/NAME.mergekit and moemerge's of the recipe
    import-mergekit makes of it to root/NAME.moemerge; the conversion."""
    from moemerge.recipe.mergekit import convert, render

    (root / f"{name}.mergekit.yaml").write_text(config)
    subprocess.run([str(bin_dir / "mergekit-moe"), str(root / f"{name}.mergekit.yaml"),
                    str(root / f"{name}.mergekit"), "--random-seed", "0", "--quiet",
                    "--device", "cpu", "--i-understand-this-is-not-useful-without-training"],
                   check=True, capture_output=True)
    converted = convert(yaml.safe_load(config))
    recipe = root / f"{name}.moemerge.yaml"
    recipe.write_text(render(converted, f"{name}.mergekit.yaml"))
    build(recipe, root / f"{name}.moemerge", progress=False, force=True, verify="structure")
    return converted


def shared_row(root: Path, bin_dir: Path, models, architecture: str, prompts) -> dict:
    """mergekit-moe with a shared expert (DeepSeek output: ungated; Qwen output: its gate from
    the prompts) against the imported recipe, every tensor by name (mergekit's DeepSeek config
    points its auto_map at the hub, so it is not loaded). The shared expert is expert 1's model:
    mergekit-moe 0.1.5 opens only the base's and the experts' files and crashes on any other
    (AttributeError: 'NoneType' object has no attribute 'get_tensor')."""

    shared = {"source_model": str(models[1]), **({"positive_prompts": prompts} if prompts
                                                 else {})}
    config = yaml.safe_dump({"base_model": str(models[0]), "gate_mode": "hidden",
                             "dtype": "float32", "architecture": architecture,
                             "shared_experts": [shared], "experts": [
        {"source_model": str(m), "positive_prompts": PROMPTS[i]}
        for i, m in enumerate(models[1:])]})
    name = f"moe-shared-{architecture}"
    converted = both_moe(root, bin_dir, name, config)
    tensors = [{k: v for f in sorted((root / f"{name}.{tool}").glob("*.safetensors"))
                for k, v in load_file(f).items()} for tool in ("mergekit", "moemerge")]
    delta = max_delta(*tensors)
    layout = converted.recipe["layout"]
    print(f"mergekit-moe (shared expert, {architecture})  {delta:.3g}", flush=True)
    what = "ungated" if prompts is None else "gate from its prompts"
    return {"method": f"mergekit-moe, 3 experts + a shared expert ({what}), architecture "
                      f"{architecture}, gate_mode hidden (routers and shared gate included)",
            "mergekit": "mergekit-moe", "options": "the recipe import-mergekit writes (merge: "
            f"base, router.init mergekit_hidden, shared_expert: {{model}}, layout: {layout})",
            "max_abs_delta": delta}


def moe_row(root: Path, bin_dir: Path, models, gate: str) -> dict:
    from transformers import AutoModelForCausalLM


    config = yaml.safe_dump({"base_model": str(models[0]), "gate_mode": gate,
                             "dtype": "float32", "experts": [
        {"source_model": str(m), "positive_prompts": PROMPTS[i],
         **({"negative_prompts": NEGATIVE[i]} if i in NEGATIVE else {})}
        for i, m in enumerate(models[1:])]})
    name = f"moe-{gate}"
    converted = both_moe(root, bin_dir, name, config)
    states = [AutoModelForCausalLM.from_pretrained(root / f"{name}.{tool}",
                                                   dtype=torch.float32).state_dict()
              for tool in ("mergekit", "moemerge")]
    routers = {k for k in states[0] if k.endswith("mlp.gate.weight")}
    assert states[0].keys() == states[1].keys() and routers
    delta = max((states[0][k] - states[1][k]).abs().max().item()
                for k in states[0] if k not in routers)
    router_delta = max((states[0][k] - states[1][k]).abs().max().item() for k in routers)
    print(f"mergekit-moe ({gate} gates)  {delta:.3g}, routers {router_delta:.3g}", flush=True)
    init = converted.recipe["router"]["init"]
    if gate == "random":
        return {"method": "mergekit-moe, 3 experts, random gates (all but the routers)",
                "mergekit": "mergekit-moe", "options": "the recipe import-mergekit writes "
                "(merge: base, router.init random, std 1)", "max_abs_delta": delta}
    return {"method": f"mergekit-moe, 3 experts, gate_mode {gate} (routers included)",
            "mergekit": "mergekit-moe", "options": f"the recipe import-mergekit writes "
            f"(merge: base, router.init {init})", "max_abs_delta": max(delta, router_delta)}


VOCAB_CASES = [  # (name, mergekit config body beside `models` / `base_model`)
    ("linear, tokenizer_source: union (3 vocabularies)",
     {"merge_method": "linear", "tokenizer_source": "union"}, False),
    ("linear, tokenizer_source: base (one tokenizer of 276 tokens, vocab_size 512)",
     {"merge_method": "linear", "tokenizer_source": "base"}, "same"),
    # (not source: base with tokens: mergekit 0.1.5 adds the tokens to the base's own tokenizer
    # object, so the base "has" each at its new id and gives the row of its embedding there:
    # docs/mergekit.md)
    ("task_arithmetic, tokenizer: {source: union, tokens: zero / model_token forced / model}, "
     "pad_to_multiple_of 64",
     {"merge_method": "task_arithmetic", "parameters": {"lambda": 1.0},
      "tokenizer": {"source": "union", "pad_to_multiple_of": 64, "tokens": {
          "<new>": {"source": {"kind": "zero"}},
          "<|im_end|>": {"source": {"kind": "model_token", "model": "@0", "token": "e"},
                         "force": True},
          "QQQ": {"source": "@2"}}}}, True),
]


def vocab_rows(root: Path, bin_dir: Path, models) -> list[dict]:
    """mergekit's tokenizer merge against the recipe import-mergekit writes: the same
    vocabulary (as token strings: mergekit appends a union's new tokens in a hash map's order,
    run to run different), each token's embedding and head rows, every other tensor."""
    from tokenizers import Tokenizer

    from moemerge.recipe.mergekit import convert, render

    own = [with_added_tokens(models[1], root / "vocab-b", ["<think>", "</think>"], 7),
           with_added_tokens(models[2], root / "vocab-c", ["<think>", "QQQ"], 8)]
    rows = []
    for name, body, with_base in VOCAB_CASES:
        merged = [models[1], models[2], models[3]] if with_base == "same" else \
            [models[1], *own]
        body = json.loads(json.dumps(body).replace('"@0"', json.dumps(str(merged[0])))
                          .replace('"@2"', json.dumps(str(merged[2]))))
        config = {**body, "dtype": "float32",
                  "models": [{"model": str(m), "parameters": {"weight": w}}
                             for m, w in zip(merged, (1.0, 0.6, 1.4), strict=True)]}
        if with_base is True:
            config["base_model"] = str(models[0])
        elif with_base == "same":
            config["base_model"] = str(merged[0])
        text = yaml.safe_dump(config)
        key = f"vocab-{len(rows)}"
        mk = run_mergekit(root, bin_dir, key, text)
        recipe = root / f"{key}.moemerge.yaml"
        recipe.write_text(render(convert(yaml.safe_load(text)), f"{key}.mergekit.yaml"))
        build(recipe, root / f"{key}.moemerge", progress=False, force=True, verify="structure")
        ours = {k: v for f in sorted((root / f"{key}.moemerge").glob("*.safetensors"))
                for k, v in load_file(f).items()}
        vocabs = [Tokenizer.from_file(str(root / f"{key}.{tool}" / "tokenizer.json"))
                  .get_vocab(with_added_tokens=True) for tool in ("mergekit", "moemerge")]
        assert set(vocabs[0]) == set(vocabs[1]), set(vocabs[0]) ^ set(vocabs[1])
        assert {k: v.shape for k, v in mk.items()} == {k: v.shape for k, v in ours.items()}
        delta = 0.0
        for tensor in mk:
            if tensor in ("model.embed_tokens.weight", "lm_head.weight"):
                for token, i in vocabs[0].items():
                    j = vocabs[1][token]
                    delta = max(delta, (mk[tensor][i] - ours[tensor][j]).abs().max().item())
                pad = len(vocabs[0])  # padding rows: the mean of the token rows in both
                delta = max(delta, (mk[tensor][pad:] - ours[tensor][pad:]).abs().max().item()
                            if len(mk[tensor]) > pad else 0.0)
            else:
                delta = max(delta, (mk[tensor] - ours[tensor]).abs().max().item())
        rows.append({"method": name, "mergekit": body["merge_method"],
                     "options": "the recipe import-mergekit writes (tokenizer: ..., rows "
                     "compared by token string)", "max_abs_delta": delta})
        print(f"{name[:40]:40s} {delta:.3g} ({len(vocabs[0])} tokens)", flush=True)
    return rows


def statistics(out: dict, base: dict, tuned: dict) -> dict:
    """Over all tensors of a one-model merge: Δ = out − base against τ = tuned − base."""
    kept = total = l1_out = l1_tau = l1_tau_kept = 0.0
    top = top_n = bottom = bottom_n = 0.0
    for name, b in base.items():
        delta, tau = out[name].float() - b.float(), tuned[name].float() - b.float()
        mask = delta != 0
        kept += mask.sum().item()
        total += mask.numel()
        l1_out += delta.abs().sum().item()
        l1_tau += tau.abs().sum().item()
        l1_tau_kept += (tau * mask).abs().sum().item()
        big = tau.abs() >= tau.abs().median()
        top, top_n = top + (mask & big).sum().item(), top_n + big.sum().item()
        bottom, bottom_n = bottom + (mask & ~big).sum().item(), bottom_n + (~big).sum().item()
    return {"kept": kept / total, "rescale": l1_out / l1_tau_kept, "l1_kept": l1_out / l1_tau,
            "kept_top_half": top / top_n, "kept_bottom_half": bottom / bottom_n}


def cosine(a: dict, b: dict, base: dict) -> float:
    da = torch.cat([(a[k].float() - base[k].float()).reshape(-1) for k in base])
    db = torch.cat([(b[k].float() - base[k].float()).reshape(-1) for k in base])
    return torch.nn.functional.cosine_similarity(da, db, dim=0).item()


def random_rows(root, bin_dir, models) -> list[dict]:
    base, tuned = (load_file(m / "model.safetensors") for m in models[:2])
    rows = []
    for case in RANDOM_CASES:
        one = case.with_models(1)
        for tool, variant, out in (
            ("mergekit", "", run_mergekit(root, bin_dir, one.name, one.mergekit(models))),
            ("moemerge", "defaults", run_moemerge(root, one.name + "-d",
                                                  one.moemerge(models, conventions=False))),
            ("moemerge", one.options, run_moemerge(root, one.name,
                                                   one.moemerge(models, conventions=True))),
        ):
            rows.append({"method": case.name, "tool": tool, "options": variant or "–",
                         **statistics(out, base, tuned)})
        mk = run_mergekit(root, bin_dir, case.name, case.mergekit(models))
        ours = run_moemerge(root, case.name, case.moemerge(models, conventions=True))
        rows[-1]["cosine_3_models"] = cosine(ours, mk, base)
        other = run_moemerge(root, case.name + "-s1",
                             case.moemerge(models, conventions=True, seed=1))
        rows[-1]["cosine_seeds"] = cosine(ours, other, base)
        print(f"{case.name:28s} cos {rows[-1]['cosine_3_models']:.4f}", flush=True)
    return rows


def report(meta: dict, exact: list[dict], randoms: list[dict]) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "mergekit_parity.json").write_text(json.dumps(
        {**meta, "exact": exact, "random": randoms}, indent=2) + "\n")
    from parity_cases import markdown

    (RESULTS / "mergekit_parity.md").write_text(markdown(meta, exact, randoms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path,
                        default=Path.home() / ".cache" / "moemerge" / "mergekit-venv")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    bin_dir, version = ensure_mergekit(opts.venv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sets = {"llama": make_models(root, opts.hidden, opts.layers)}

        def model_sets(family: str) -> list[Path]:
            if family not in sets:
                sets[family] = make_models(root, opts.hidden, opts.layers, family)
            return sets[family]

        models = sets["llama"]
        params = sum(t.numel() for t in load_file(models[0] / "model.safetensors").values())
        meta = {"provenance": provenance(), "mergekit": version, "hidden": opts.hidden,
                "layers": opts.layers, "params": params}
        exact = exact_rows(root, bin_dir, model_sets)
        exact += moe_rows(root, bin_dir, models)
        exact += vocab_rows(root, bin_dir, models)
        randoms = random_rows(root, bin_dir, models)
    report(meta, exact, randoms)


if __name__ == "__main__":
    main()
