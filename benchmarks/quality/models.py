"""The models of the quality benchmark (run.py): recipes, builds, fine-tunes, dense controls.

`Models.get(key, seed)` makes a model on first use and keeps it for the run: a build from
`recipes()`, a fine-tune of another model (`TRAINED`), or the dense control (`CONTROLS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# three prompts per expert for `router.init: prompts` (the demo's recipe has the first three)
PROMPTS = {
    "code": ["def __init__(self, name, value=None):\n    self.name = name\n",
             "for index, item in enumerate(items):\n    if item is None:\n        continue\n",
             "import os\nimport sys\n\ndef main(argv):\n    return 0\n"],
    "prose": ["Return a new list containing the items of the iterable in sorted order.",
              "This module provides a simple interface to the operating system's file system.",
              "If the optional argument is given, it is used as the default value."],
    "math": ["Q: What is 47 + 38? A: 47 + 38 = 85.",
             "Q: Solve 3x + 5 = 20. A: Subtract 5 from both sides: 3x = 15. Divide by 3: x = 5.",
             "Q: What is 12 * 7? A: 12 * 7 = 84."],
    "cpp": ["#include <ATen/core/Tensor.h>\n\nnamespace at {\nnamespace native {\n",
            "template <typename T>\ninline C10_HOST_DEVICE T max(T a, T b) {\n  return a > b;\n}",
            "TORCH_API Tensor& add_out(Tensor& out, const Tensor& self, const Scalar& other);"],
}
# the recipes' own values; the dense TIES / DARE-TIES rows are built with λ and density tuned
TIES = "{method: ties, density: 0.7, lambda: 0.5}"
DARE = "{method: dare_ties, density: 0.7, lambda: 0.5}"
SEEDED = {"token_random", "upcycle"}  # builds whose weights depend on the recipe's seed
TUNED = {"dense_ties", "dense_dare", "token_cal_ties"}  # built with `build --tune-on`


def _experts(paths: dict[str, Path], prompts: bool = False) -> list[str]:
    lines = ["experts:"]
    for d, p in paths.items():
        lines.append(f"  - model: {p}\n    name: {d}")
        if prompts:
            lines.append("    positive_prompts: [" + ", ".join(map(repr, PROMPTS[d])) + "]")
    return lines


def calibration(ts, seq_len: int, tokens: int, **fields) -> str:
    """router.init: calibrate's block: each domain's training text, named after its expert;
    `fields` adds more calibration fields (e.g. confidence="fit", targets="loss")."""
    data = ", ".join(f"{d}={p}" for d, p in ts.train_text.items())
    more = "".join(f", {k}: {v}" for k, v in fields.items())
    return f"calibration: {{data: [{data}], max_tokens: {tokens}, seq_len: {seq_len}{more}}}"


def recipes(ts, seed: int, prompt: int, tokens: int = 8192) -> dict[str, list[str]]:
    """{key: recipe lines} of every model built from the toy set `ts`. Sequence routers are
    calibrated on windows as long as the `prompt` they route on; token and segment routers on
    128-token windows."""
    base, moe = f"base_model: {ts.base}", ["kind: moe", f"seed: {seed}"]
    token = [*moe, base, "experts_per_token: 2", "merge: {method: average}"]
    seq = [*moe, "assembly: seq_routed", base, *_experts(ts.experts),
           "per_expert: [embed, lm_head]"]
    merged = [*moe, "assembly: merged_experts", base, *_experts(ts.experts),
              "segment_length: 16", "router: {init: calibrate}", calibration(ts, 128, tokens)]
    models = ", ".join(map(str, ts.experts.values()))
    dense = ["kind: merge", f"seed: {seed}", base, f"models: [{models}]"]
    return {
        "dense_average": [*dense, "merge: {method: average}"],
        "dense_ties": [*dense, f"merge: {TIES}"],
        "dense_dare": [*dense, f"merge: {DARE}"],
        "token_random": [*token, *_experts(ts.experts), "router: {init: random}"],
        # only where every domain has PROMPTS (heldout.py's new domains have none)
        **({"token_prompts": [*token, *_experts(ts.experts, prompts=True),
                              "router: {init: prompts}"]} if set(ts.experts) <= set(PROMPTS)
           else {}),
        "token_cal": [*token, *_experts(ts.experts), "router: {init: calibrate}",
                      calibration(ts, 128, tokens)],
        # the shared (non-FFN) tensors by TIES, λ / density tuned on the MoE itself
        "token_cal_ties": [*moe, base, "experts_per_token: 2", f"merge: {TIES}",
                           *_experts(ts.experts), "router: {init: calibrate}",
                           calibration(ts, 128, tokens)],
        "seq_ppl": [*seq, "router: {kind: perplexity}"],
        "seq_tv": [*seq, "router: {kind: task_vector}"],
        "seq_cal": [*seq, "router: {kind: learned, init: calibrate}",
                    calibration(ts, prompt, tokens)],
        "merged_cal": [*merged, "curvature: {kind: none}"],
        "camex_cal": [*merged, "curvature: {kind: kronecker}"],
        "upcycle": ["kind: upcycle", f"model: {ts.base}", f"experts: {len(ts.experts)}",
                    "experts_per_token: 2", "router: {init: virtual_group}", f"seed: {seed}"],
    }


@dataclass(frozen=True)
class Trained:
    """A fine-tune of `parent`: `phase` "router" (--steps at --lr, experts frozen), "full"
    (--full-steps at --full-lr) or "pipeline" (both phases' steps at --full-lr, all weights)."""

    parent: str
    parts: tuple[str, ...]
    phase: str


TRAINED = {
    "token_random+r": Trained("token_random", ("routers",), "router"),
    "token_cal+r": Trained("token_cal", ("routers",), "router"),
    "token_cal+r+f": Trained("token_cal+r", ("all",), "full"),
    "merged_cal+r": Trained("merged_cal", ("routers",), "router"),
    "camex_cal+rc": Trained("camex_cal", ("routers", "curvature"), "router"),
    "upcycle+f": Trained("upcycle", ("all",), "pipeline"),
}
CONTROLS = {"dense+router": "router", "dense+pipeline": "pipeline"}  # the base trained on


class Models:
    """Every model of the run by (key, seed), made on first use; `tune` (TuneOptions) sets λ
    and density of the dense TIES / DARE-TIES builds."""

    def __init__(self, ts, args, work: Path, tune):
        self.ts, self.args, self.work, self.tune = ts, args, work, tune
        self.made: dict[tuple[str, int], object] = {("base", 0): ts.base}
        self.made |= {(f"expert:{d}", 0): p for d, p in ts.experts.items()}
        self.tuned: dict[str, dict] = {}  # key -> the build's chosen λ / density per role

    def steps(self, phase: str) -> tuple[int, float]:
        a = self.args
        return {"router": (a.steps, a.lr), "full": (a.full_steps, a.full_lr),
                "pipeline": (a.steps + a.full_steps, a.full_lr)}[phase]

    def get(self, key: str, seed: int = 0):
        if (key, seed) not in self.made:
            self.made[key, seed] = self._make(key, seed)
        return self.made[key, seed]

    def _make(self, key: str, seed: int):
        out = self.work / f"{key}-s{seed}"
        if key == "dense_btx":  # the experts' own training, on every domain (cached)
            from moemerge.toy.real_experts import cached_mixture_control

            return cached_mixture_control(self.ts, extra_steps=self.args.steps)
        if key in CONTROLS:  # as many steps as the rows it controls, at the full fine-tune's lr
            steps = self.steps(CONTROLS[key])[0]
            return train_dense(self.ts, self.ts.base, steps, self.args.full_lr, seed, self.args)
        if key in TRAINED:
            t = TRAINED[key]
            parent = self.get(t.parent, seed if (t.parent in SEEDED or t.parent in TRAINED)
                              else 0)
            steps, lr = self.steps(t.phase)
            return finetune(self.ts, parent, out, list(t.parts), steps, lr, seed, self.args)
        tune = self.tune if key in TUNED else None
        result = build_result(recipes(self.ts, seed, self.args.prompt_tokens,
                                             self.args.calibration_tokens)[key], out, tune)
        if result.tuning is not None:
            self.tuned[key] = result.tuning.chosen
        return out


def build_result(lines: list[str], out: Path, tune=None):
    """moemerge.api.build of the recipe `lines` (written beside `out`); its BuildResult."""
    from moemerge.api import build as build_model

    out.parent.mkdir(parents=True, exist_ok=True)
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text("\n".join(lines) + "\n")
    return build_model(recipe, out, progress=False, tune=tune)


def build(lines: list[str], out: Path) -> Path:
    build_result(lines, out)
    return out


def add_training_options(parser) -> None:
    """The options `finetune` and `train_dense` read from the parsed args (see `_config`)."""
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-fraction", type=float, default=0.02)
    parser.add_argument("--gradient-checkpointing", action="store_true", default=None,
                        help="finetune --gradient-checkpointing (the smollm2 preset's: CAMEx's "
                        "curvature training peaks past 21 GB without it, 12 GiB with it)")


def _config(ts, model: Path, out: Path, parts: list[str], steps: int, lr: float, seed: int,
            args, **extra):
    from moemerge.train.config import make_config

    return make_config(None, extra | {
        "model": str(model), "output": str(out), "train": parts, "steps": steps, "lr": lr,
        "data": [f"{d}={p}" for d, p in ts.train_text.items()], "seq_len": args.seq_len,
        "batch_size": args.batch_size, "eval_fraction": args.eval_fraction, "device": "cpu",
        "seed": seed, "gradient_checkpointing": bool(args.gradient_checkpointing)})


def finetune(ts, model: Path, out: Path, parts: list[str], steps: int, lr: float, seed: int,
             args, **extra) -> Path:
    """`extra`: more finetune config fields (e.g. aux_loss_coef)."""
    from moemerge.train.api import finetune as run_finetune

    run_finetune(_config(ts, model, out, parts, steps, lr, seed, args, **extra))
    return out


def train_dense(ts, model: Path, steps: int, lr: float, seed: int, args):
    """The compute-matched dense control, trained by moemerge's own training step (finetune
    refuses dense models): the same blocks, batches (a pure function of seed and step), AdamW,
    warm-up + cosine schedule, clipping and loss as `finetune --full` with these settings.
    Returns (model, tokenizer) in memory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moemerge.data import read_domains
    from moemerge.loading import quiet_transformers
    from moemerge.token_blocks import make_blocks
    from moemerge.train import distributed, loop

    cfg = _config(ts, model, model.parent / "unused", ["all"], steps, lr, seed, args)
    with quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(model)
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    blocks = make_blocks(read_domains(cfg.data, text_field=cfg.text_field), tokenizer, cfg.seq_len,
                         cfg.eval_fraction)
    ctx = distributed.setup("cpu")
    trainable = [p for p in net.parameters() if p.requires_grad]
    torch.manual_seed(cfg.seed)
    optim = loop.make_optim(trainable, cfg, steps)
    net.train()
    for step in range(steps):
        loop.train_step(net, optim, blocks, step, cfg, ctx, trainable)
    return net.eval(), tokenizer
