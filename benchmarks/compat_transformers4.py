"""Do transformers 4 and 5 compute the same logits from a moemerge output?

Every output kind: token-routed MoEs of each family, and the seq_routed / bridged /
merged_experts kinds through the modeling code shipped next to their weights
(trust_remote_code); plus a Mixtral from a source with Llama-3.2-1B's published config (tied
embeddings, llama3 rope scaling), shrunk.

transformers 5 reads `rope_parameters`, transformers 4 reads `rope_theta`; an output that only
one of them understands loads in the other with the MoE class's defaults (Mixtral: rope_theta
1e6) and silently gives other logits. This builds an MoE from perturbed experts for every source
family with the installed moemerge (transformers 5), computes logits here, then in a Python that
has transformers 4 (`--python`; the floor moemerge admits, 4.56.2), and records the max |diff|.

    python3 -m venv /tmp/t4 && /tmp/t4/bin/pip install torch==2.13.0 "transformers==4.56.2"
    python benchmarks/compat_transformers4.py --python /tmp/t4/bin/python
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from stamp import provenance, stamp_line

RESULTS = Path(__file__).parent / "results"
LOGITS = r"""
import sys, torch, transformers
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32,
                                             trust_remote_code=True).eval()
ids = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[3])
print(transformers.__version__)
"""


def logits_in(python: str, model: Path, ids: Path, out: Path) -> str:
    done = subprocess.run([python, "-c", LOGITS, str(model), str(ids), str(out)],
                          check=True, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1]


def make_base(family: str, path: Path) -> Path:
    from moemerge.toy.experts import make_random_model
    from moemerge.toy.published import published_model

    if family == "llama-3.2-1b":
        return published_model(family, path, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=256,
                               dtype=torch.float32)
    return make_random_model(family, path, hidden=64, layers=2, vocab=256)


def build_moe(root: Path, family: str, kind: str = "token_routed") -> Path:
    from safetensors.torch import load_file, save_file

    from moemerge.api import build
    from moemerge.toy.experts import make_random_model

    root = root / f"{family}-{kind}"
    root.mkdir()
    base = make_base(family, root / "base")
    experts = []
    for e in range(2):
        expert = root / f"e{e}"
        expert.mkdir()
        (expert / "config.json").write_bytes((base / "config.json").read_bytes())
        gen = torch.Generator().manual_seed(e)
        tensors = {n: t + 0.05 * torch.randn(t.shape, generator=gen)
                   for n, t in load_file(base / "model.safetensors").items()}
        save_file(tensors, expert / "model.safetensors", metadata={"format": "pt"})
        experts.append(expert)
    settings = {
        "token_routed": f"base_model: {base}\nexperts_per_token: 1\nrouter: {{init: task_vector}}",
        "seq_routed": f"base_model: {base}\nexperts_per_sequence: 2\nrouter: {{kind: "
                      "task_vector}",
        # a narrower Qwen2 next to the first expert, bridged by identity projectors
        "bridged": "experts_per_sequence: 2\nprojectors: {hidden_size: 16}",
        "merged_experts": f"base_model: {base}\nsegment_length: 8\ncurvature: {{rank: 2}}\n"
                          "mask: {kind: ties}\ndynamic: true\nrouter: {std: 1.0}",
    }[kind]
    if kind == "bridged":
        experts[1] = make_random_model("qwen2", root / "narrow", hidden=32, layers=3,
                                       vocab=256)
    recipe = root / "recipe.yaml"
    recipe.write_text(f"kind: moe\nassembly: {kind}\nexperts: [{experts[0]}, {experts[1]}]\n"
                      f"{settings}\n")
    build(recipe, root / "moe", progress=False)
    return root / "moe"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", required=True, help="a Python with transformers 4 (4.56.2)")
    opts = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
        torch.save(ids, root / "ids.pt")
        cases = [(f, "token_routed") for f in ("llama", "mistral", "qwen2", "qwen3")]
        cases += [("llama-3.2-1b", "token_routed"), ("qwen3", "seq_routed"),
                  ("llama", "bridged"), ("qwen2", "merged_experts")]
        for family, kind in cases:
            moe = build_moe(root, family, kind)
            v5 = logits_in(sys.executable, moe, root / "ids.pt", root / "v5.pt")
            v4 = logits_in(opts.python, moe, root / "ids.pt", root / "v4.pt")
            diff = (torch.load(root / "v5.pt") - torch.load(root / "v4.pt")).abs().max().item()
            config = json.loads((moe / "config.json").read_text())
            arch = config["architectures"][0] + (f" ({config['assembly']})"
                                                 if "assembly" in config else "")
            rows.append({"family": family, "output": arch, "transformers_5": v5,
                         "transformers_4": v4, "max_abs_diff": diff})
        # control: the same llama MoE with a transformers-5 style config (rope_parameters, no
        # rope_theta) is what a careless writer produces; transformers 4 must disagree with it
        control = root / "control"
        shutil.copytree(root / "llama-token_routed" / "moe", control)
        config = json.loads((control / "config.json").read_text())
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
        config.pop("rope_scaling", None)
        (control / "config.json").write_text(json.dumps(config))
        logits_in(sys.executable, control, root / "ids.pt", root / "v5.pt")
        logits_in(opts.python, control, root / "ids.pt", root / "v4.pt")
        diff = (torch.load(root / "v5.pt") - torch.load(root / "v4.pt")).abs().max().item()
        rows.append({"family": "llama (control: rope_parameters only)",
                     "output": config["architectures"][0],
                     "transformers_5": v5, "transformers_4": v4, "max_abs_diff": diff})
    lines = ["# transformers 4 vs 5 on moemerge outputs", "", stamp_line(provenance()), "",
             "| source | output | transformers 5 | transformers 4 | max abs logit diff |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['family']} | {r['output']} | {r['transformers_5']} | {r['transformers_4']} "
              f"| {r['max_abs_diff']:.2e} |" for r in rows]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compat_transformers4.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
