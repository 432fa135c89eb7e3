"""Token routers refitted from stored statistics plus new calibration rows (`moemerge extend`).

The model is the extended MoE (new experts' FFNs in place, placeholder routers [E', H]). Layer
by layer, as calibrate.calibrate_token_routers does: the new text's router inputs are captured
with the refitted routers of the layers below, their statistics are added to the stored ones
(padded to E' experts: an old row's target for a new expert is 0), and the router is solved
from the sum. Only the new text runs through the model.
"""

from __future__ import annotations

import torch

from moemerge.routing.calibrate import Calibration, token_gates, token_rows
from moemerge.routing.ridge import held_out_windows
from moemerge.routing.statistics import LayerStatistics, layer_statistics, refit


def refit_token_routers(model, cal: Calibration, stored: dict[int, LayerStatistics],
                        window_offset: int, *, with_stored: bool = True
                        ) -> tuple[dict[int, torch.Tensor], dict[int, LayerStatistics]]:
    """({layer: router [E', H]}, {layer: the summed statistics}); `cal` holds the new text
    only, its windows numbered from `window_offset` (the windows the stored statistics saw).
    with_stored=False fits on the new rows alone (what the tests show differs)."""
    experts = cal.targets.shape[-1]
    routers, summed = {}, {}
    gates = list(enumerate(token_gates(model, experts)))
    for layer, gate, x, window in token_rows(model, cal.ids, gates):
        new = layer_statistics(x, cal.targets.reshape(-1, experts),
                               held_out_windows(window + window_offset))
        summed[layer] = stored[layer].padded(experts) + new if with_stored else new
        routers[layer] = refit(summed[layer], cal.confidence)
        gate.weight.data.copy_(routers[layer])
    return routers, summed
