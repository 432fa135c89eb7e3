"""config.json's shape fields checked against the tensor headers, before any data is read.

The output config is copied from the source's, so a config that lies (num_hidden_layers 10^12,
a wrong intermediate_size) would make a model that does not load, or a check that never ends.
"""

from __future__ import annotations

from moemerge.architectures import TensorRole
from moemerge.errors import CheckpointError

REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "vocab_size")
OPTIONAL = ("num_key_value_heads", "head_dim")  # absent or null: heads, hidden_size / heads
# per-layer tensor (name suffix) -> expected [rows, cols] in terms of the config's fields
LAYER_SHAPES = {
    "self_attn.q_proj.weight": ("q", "hidden_size"),
    "self_attn.k_proj.weight": ("kv", "hidden_size"),
    "self_attn.v_proj.weight": ("kv", "hidden_size"),
    "self_attn.o_proj.weight": ("hidden_size", "q"),
    "mlp.gate_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.up_proj.weight": ("intermediate_size", "hidden_size"),
    "mlp.down_proj.weight": ("hidden_size", "intermediate_size"),
    "self_attn.qkv_proj.weight": ("qkv", "hidden_size"),  # Phi-3: q, k, v rows fused
    "mlp.gate_up_proj.weight": ("gate_up", "hidden_size"),  # Phi-3: gate rows, then up rows
}


def projection_rows(config: dict) -> dict[str, int]:
    """Output rows of the attention and fused projections, from config.json's shape fields."""
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return {"q": heads * head_dim, "kv": kv * head_dim, "qkv": (heads + 2 * kv) * head_dim,
            "gate_up": 2 * config["intermediate_size"]}


def check_config_shapes(config: dict, roles: dict[str, TensorRole], shapes: dict[str, tuple],
                        where: str) -> None:
    """Every shape field of `config` agrees with the tensors' `shapes`; `where` is
    "label: model directory", so each message names the model and its config.json."""
    for key in REQUIRED + OPTIONAL:
        value = config.get(key)
        if value is None and key in OPTIONAL:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{where}/config.json: {key} is "
                                  f"{'missing' if value is None else repr(value)[:40]}; it must "
                                  "be a positive integer")
    sizes = dict(config) | projection_rows(config)
    layers = sorted({r.layer for r in roles.values() if r.layer is not None})
    consecutive = layers == list(range(len(layers)))  # never range(num_hidden_layers): 10^12
    if not consecutive or len(layers) != config["num_hidden_layers"]:
        found = f"layers 0..{layers[-1]}" if layers and consecutive \
            else f"layer indices {layers[:5]}{'…' if len(layers) > 5 else ''}"
        raise CheckpointError(f"{where}/config.json: num_hidden_layers is "
                              f"{config['num_hidden_layers']} but the tensors have {found}")
    for name, role in roles.items():
        if role.role == "embed":
            expected = (config["vocab_size"], config["hidden_size"])
        elif role.layer is not None and (suffix := name.split(".", 3)[3]) in LAYER_SHAPES:
            expected = tuple(sizes[k] for k in LAYER_SHAPES[suffix])
        else:
            continue
        if tuple(shapes[name]) != expected:
            raise CheckpointError(f"{where}: tensor {name!r} is {list(shapes[name])} but "
                                  f"config.json's shape fields make it {list(expected)}")
