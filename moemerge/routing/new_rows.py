"""Router rows for new experts of an MoE whose routers were trained elsewhere (a hub Mixtral,
Qwen-MoE, ...: no recipe copy, no calibration text, no router statistics), as `moemerge
extend` grows it (docs/extend.md).

The old rows are kept as they are: among the old experts every token is ranked as before.
Each new expert's row is fitted in closed form, layer by layer on the grown model as
calibrate.calibrate_token_routers walks it (the routers below already grown), by ridge
regression from the router's inputs to a target logit set from the old router's own logits
L [R, E] of the same rows:

- on the new expert's own text, its top old logit plus a margin: the new expert comes first;
- on every other text (the MoE's own `moe=` text, the other new experts' texts), its k-th
  old logit (k = experts per token) minus the margin: the new expert is not chosen.

The margin is the mean spread (standard deviation over the experts) of the old logits, so the
targets are in the old router's own scale and no decisive scale is applied. λ is chosen on
held-out windows as a build's calibration chooses it (ridge.solve_equations, targets not
centred: a single row has no mean over experts to remove).
"""

from __future__ import annotations

import torch

from moemerge.routing.calibrate import fit_token_routers
from moemerge.routing.modules import find_routers
from moemerge.routing.ridge import held_out_windows, normal_equations, solve_equations


def new_row_targets(logits: torch.Tensor, own: torch.Tensor, top_k: int) -> torch.Tensor:
    """Old logits [R, E] and own [R, n] (row r is new expert j's own text) -> each new
    expert's target logit [R, n] float64."""
    z = logits.double()
    ranked = z.topk(min(top_k, z.shape[1]), dim=-1).values  # [R, k], largest first
    margin = float(z.std(dim=-1, unbiased=False).mean())
    high, low = ranked[:, :1] + margin, ranked[:, -1:] - margin
    return torch.where(own, high, low)


def fit_new_rows(x: torch.Tensor, old: torch.Tensor, own: torch.Tensor, window: torch.Tensor,
                 top_k: int) -> torch.Tensor:
    """Rows x [R, H], the old router [E, H], own [R, n], each row's window [R] -> the new rows
    [n, H] float64."""
    y = new_row_targets(x.double() @ old.double().T, own, top_k)
    held = held_out_windows(window)
    if bool(held.any()) and bool((~held).any()):
        fit, test = normal_equations(x[~held], y[~held]), normal_equations(x[held], y[held])
    else:
        fit, test = normal_equations(x, y), None
    rows, _ = solve_equations(fit, test)
    return rows


def grown_routers(model, ids: torch.Tensor, domain: torch.Tensor, new_domains: list[int],
                  old: dict[int, torch.Tensor], top_k: int) -> dict[int, torch.Tensor]:
    """{layer: router [E + n, H]} of the grown MoE `model` (new experts' FFNs in place,
    placeholder routers): windows ids [W, S+1], domain [W] each window's text, new_domains[j]
    the text of new expert j, old {layer: the MoE's router [E, H]} (kept, as they are, in the
    first E rows)."""
    experts = next(iter(old.values())).shape[0] + len(new_domains)
    gates = find_routers(model, experts)
    if sorted(layer for layer, _ in gates) != sorted(old):
        raise ValueError(f"routers with {experts} rows found in layers "
                         f"{[layer for layer, _ in gates]}, the MoE's are in {sorted(old)}")
    wanted = torch.tensor(new_domains)

    def fit(layer: int, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        own = domain[window][:, None] == wanted[None, :]  # [R, n]
        rows = fit_new_rows(x, old[layer], own, window, top_k)
        return torch.cat([old[layer].double(), rows]).float()

    return fit_token_routers(model, ids, gates, fit)
