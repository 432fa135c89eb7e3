"""The prompts router init records what each layer's FFN (so its router) reads."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from moemerge.architectures import dense_families
from moemerge.routing.prompts import _per_layer_means

IDS = [torch.randint(4, 256, (7,), generator=torch.Generator().manual_seed(s)) for s in (0, 1)]


@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_router_input_is_the_ffn_input(family, model_factory):
    """Llama's FFN reads the post-attention-normed state; OLMo 2's reads the residual stream
    itself (its post_attention_layernorm norms the attention output before the residual add),
    reconstructed here from the layer's input plus that normed attention output."""
    model = AutoModelForCausalLM.from_pretrained(model_factory(family), dtype=torch.float32)
    ffn_module = dense_families()[family].ffn_module
    recorded = _per_layer_means(model.eval(), IDS, ffn_module)  # [L, H]

    normed = {}
    hooks = [layer.post_attention_layernorm.register_forward_hook(
        lambda _m, _i, out, index=index: normed.__setitem__(index, out[0]))
        for index, layer in enumerate(model.model.layers)]
    sums = torch.zeros_like(recorded)
    with torch.no_grad():
        for ids in IDS:
            states = model(input_ids=ids[None], output_hidden_states=True).hidden_states
            for index in range(len(model.model.layers)):  # states[index]: the layer's input
                ffn_input = normed[index] + (states[index][0] if family == "olmo2" else 0)
                sums[index] += ffn_input.sum(0)
    for hook in hooks:
        hook.remove()
    expected = sums / sum(ids.numel() for ids in IDS)
    torch.testing.assert_close(recorded, expected, atol=1e-5, rtol=1e-5)
