"""routing/capture.py: the rows each router sees, walking the decoder stack once, against a
plain full forward of the model for every layer (with the routers set so far)."""

import pytest
import torch
from transformers import MixtralConfig, MixtralForCausalLM

from moemerge.routing.calibrate import token_gates
from moemerge.routing.capture import BATCH, layer_rows

LAYERS = 6


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=LAYERS, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    return MixtralForCausalLM(config).eval()


def gates(model):
    """Each layer's router (`mlp.gate` in transformers 5, `block_sparse_moe.gate` in 4)."""
    return token_gates(model, 4)


def full_forward_rows(model, ids, gate) -> torch.Tensor:
    """The reference: the whole model on every batch, the gate's inputs recorded."""
    rows = []
    handle = gate.register_forward_pre_hook(lambda _m, args: rows.append(args[0].reshape(
        -1, args[0].shape[-1]).float()))
    try:
        with torch.no_grad():
            for start in range(0, ids.shape[0], BATCH):
                model(input_ids=ids[start:start + BATCH, :-1])
    finally:
        handle.remove()
    return torch.cat(rows)


def test_each_layer_sees_what_a_full_forward_shows_with_the_routers_set_so_far(model):
    """Between yields the test sets a new random router, as calibration sets the fitted one:
    the next layers' rows must be those a full forward computes with it (stale hidden states
    would fail), and each window's rows are numbered by window."""
    ids = torch.randint(0, 97, (2 * BATCH + 3, 17))
    windows = ids.shape[0]
    gen = torch.Generator().manual_seed(1)
    seen = []
    taps = [(layer, gate, gate) for layer, gate in enumerate(gates(model))]
    for layer, _, rows, window in layer_rows(model, ids, taps):
        seen.append(layer)
        reference = full_forward_rows(model, ids, gates(model)[layer])
        assert torch.equal(rows, reference), layer
        assert torch.equal(window, torch.arange(windows).repeat_interleave(16))
        gates(model)[layer].weight.data.copy_(torch.randn(4, 32, generator=gen) * 3)
    assert seen == list(range(LAYERS))


def test_the_walk_runs_each_layer_at_most_three_times_per_batch(model):
    """A full forward per layer runs L(L+1)/2 layer calls per batch (21 here); the walk runs
    at most 3L (one recording forward, then each layer up to its router and whole)."""
    ids = torch.randint(0, 97, (BATCH, 9))
    calls = [0] * LAYERS
    handles = [layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
               for i, layer in enumerate(model.model.layers)]
    try:
        for _ in layer_rows(model, ids, [(layer, gate, gate)
                                         for layer, gate in enumerate(gates(model))]):
            pass
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [3] * (LAYERS - 1) + [2]  # the last layer never runs whole


def test_skipped_layers_advance_with_their_routers(model):
    """Taps on layers 1 and 4 only (shrink's repair skips layers it did not shrink): layers
    0, 2 and 3 still run, with the routers they hold."""
    ids = torch.randint(0, 97, (BATCH + 2, 9))
    taps = [(4, gates(model)[4], gates(model)[4]), (1, gates(model)[1], gates(model)[1])]
    got = {layer: rows for layer, _, rows, _ in layer_rows(model, ids, taps)}
    assert list(got) == [1, 4]
    for layer in (1, 4):
        assert torch.equal(got[layer], full_forward_rows(model, ids, gates(model)[layer]))
