"""`experts_per_token: auto`: the number of experts each token uses, chosen on the built MoE.

For each candidate k (1 to the number of experts) the built model is loaded with
`num_experts_per_tok` = k, as a user's `from_pretrained` loads that config, its routers are
calibrated under that k, and it is scored by its mean next-token loss on the held-out
calibration windows (those ridge regression chose its λ on: routing/ridge.held_out_windows).
The smallest k whose loss is within MIN_GAIN of the best is chosen, with its routers: each
expert more per token costs a whole FFN of compute, so it has to pay for itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from moemerge.loading import load_pretrained
from moemerge.routing.calibrate import token_nll
from moemerge.routing.ridge import held_out_windows

MIN_GAIN = 1e-3  # relative loss a larger k must save over a smaller one to be chosen


@dataclass(frozen=True)
class TopKChoice:
    chosen: int
    losses: dict[int, float]  # k -> mean held-out next-token loss (nats)

    def losses_text(self) -> str:
        return ", ".join(f"{k}: {loss:.4f}" for k, loss in self.losses.items())

    def describe(self) -> str:
        return f"experts_per_token {self.chosen} (held-out loss per k: {self.losses_text()})"


def held_out_ids(ids: torch.Tensor) -> torch.Tensor:
    """The held-out windows of ids [W, S+1] (every window when there are too few to split)."""
    held_out = held_out_windows(torch.arange(ids.shape[0]))
    return ids[held_out] if bool(held_out.any()) else ids


def smallest_sufficient(losses: dict[int, float]) -> int:
    """The smallest k whose loss is within MIN_GAIN (relative) of the best."""
    best = min(losses.values())
    return min(k for k, loss in losses.items() if loss <= best + MIN_GAIN * abs(best))


@torch.no_grad()
def choose_top_k(model_with_k: Callable[[int], torch.nn.Module], ids: torch.Tensor,
                 num_experts: int) -> TopKChoice:
    """Score model_with_k(k) for every k in 1..num_experts on the windows ids [W, S+1]
    (already held out) and choose. The build's model_with_k calibrates the routers of a model
    loaded with k experts per token (what each layer's router sees depends on the k of the
    layers below), so each k is scored with its own routers."""
    losses = {}
    for k in range(1, num_experts + 1):
        model = model_with_k(k)
        losses[k] = float(token_nll(model, ids).double().mean())
        del model
    return TopKChoice(smallest_sufficient(losses), losses)


def loaded_with_k(model_dir: Path) -> Callable[[int], torch.nn.Module]:
    """k -> the model at model_dir as `from_pretrained` loads it with num_experts_per_tok k."""
    return lambda k: load_pretrained("AutoModelForCausalLM", model_dir, dtype="auto",
                                     num_experts_per_tok=k).eval()


def chosen_recipe_text(recipe_text: str, choice: TopKChoice) -> str:
    """The recipe with `experts_per_token: auto` replaced by the chosen k (a rebuild from the
    copy gives the same model), headed by a comment with every candidate's loss. Re-serialised:
    the recipe's own comments are not kept (as a tuned recipe's are not)."""
    data = yaml.safe_load(recipe_text)
    data["experts_per_token"] = choice.chosen
    header = (f"# experts_per_token: auto chose {choice.chosen} on the held-out calibration "
              f"windows (mean next-token loss per k: {choice.losses_text()})")
    return header + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None)
