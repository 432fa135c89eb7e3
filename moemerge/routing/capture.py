"""What a router sees, captured layer by layer in one walk down the decoder stack.

Routers are fitted in layer order: layer l's inputs must be computed with the routers of the
layers below already fitted (their choices change what reaches layer l). Running the model from
its embedding again for every layer costs L(L+1)/2 layer forwards (465 for SmolLM2's 30
layers). Here the calibration windows' hidden states [W, S, H] are kept between layers
instead: one forward records what the model passes each decoder layer besides its hidden state
(rotary embeddings, masks: they depend on the positions, not on the routers), then each layer
runs twice, up to its router to capture the router's inputs, and whole once the caller has set
the fitted router: about 3L layer forwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

BATCH = 8  # windows per forward


class _Stop(Exception):
    """Raised by a hook once the module being captured has seen its inputs."""


def _halt(*_) -> None:
    raise _Stop


Tap = tuple[int, torch.nn.Module, torch.nn.Module]  # (layer, module, stop)


@torch.no_grad()
def layer_rows(model, ids: torch.Tensor, taps: list[Tap]
               ) -> Iterator[tuple[int, torch.nn.Module, torch.Tensor, torch.Tensor]]:
    """For each (layer, module, stop) of `taps` in layer order, yield (layer, module, rows
    [R, H] fp32, window index of each row [R]): every input row `module` sees on the windows
    ids [W, S+1], layer `layer` cut short after `stop` ran. A call's input [B, ..., H] (or its
    batch-major flattening [B·m, H]) holds m rows per window. Between two yields the caller
    may change the layer's router: the layers are advanced with it when the walk resumes."""
    layers = list(model.model.layers)
    batches = [ids[start:start + BATCH, :-1] for start in range(0, ids.shape[0], BATCH)]
    hidden, calls = _record_calls(model, layers, batches)
    done = 0  # layers whose outputs `hidden` holds
    for layer, module, stop in sorted(taps, key=lambda tap: tap[0]):
        for index in range(done, layer):
            hidden = [_output(layers[index](h, *args, **kwargs))
                      for h, (args, kwargs) in zip(hidden, (c[index] for c in calls),
                                                   strict=True)]
        done = layer
        yield layer, module, *_capture(layers[layer], module, stop, hidden,
                                       [c[layer] for c in calls])


def _record_calls(model, layers, batches) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """One forward per batch: (each batch's input of the first layer, each batch's per-layer
    (args, kwargs) beside the hidden state)."""
    hidden, calls = [], []

    def record(index: int):
        def hook(_module, args, kwargs):
            if index == 0:
                hidden.append(args[0] if args else kwargs["hidden_states"])
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            calls[-1].append((args[1:], rest))
        return hook

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    try:
        for batch in batches:
            calls.append([])
            model(input_ids=batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return hidden, calls


def _capture(layer, module, stop, hidden, calls) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R, H] fp32, window [R]) `module` sees while `layer` runs on each batch, each run
    cut short after `stop`."""
    rows, windows, batch = [], [], {"first": 0, "size": 0}

    def record(_module, args):
        x = args[0].detach().float()
        x = x.reshape(batch["size"], -1, x.shape[-1])  # [B, m, H]
        rows.append(x.reshape(-1, x.shape[-1]))
        windows.append(torch.arange(batch["first"], batch["first"] + batch["size"])
                       .repeat_interleave(x.shape[1]))

    handles = [module.register_forward_pre_hook(record), stop.register_forward_hook(_halt)]
    try:
        for h, (args, kwargs) in zip(hidden, calls, strict=True):
            batch["size"] = h.shape[0]
            try:
                layer(h, *args, **kwargs)
            except _Stop:
                pass
            batch["first"] += h.shape[0]
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(rows), torch.cat(windows)


def _output(out) -> torch.Tensor:
    """A decoder layer's hidden state (transformers 4 returns a tuple, 5 the tensor)."""
    return out[0] if isinstance(out, tuple) else out
