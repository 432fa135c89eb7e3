"""config.json's shape fields checked against the tensor headers, before any data is read.

The output config is copied from the source's, so a config that lies (num_hidden_layers 10^12,
a wrong intermediate_size) would make a model that does not load, or a check that never ends.
"""

from __future__ import annotations

import math

import torch

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
                        where: str, attention: bool = True) -> None:
    """Every shape field of `config` agrees with the tensors' `shapes`; `where` is
    "label: model directory", so each message names the model and its config.json.
    `attention` False: the attention's shapes are not the heads' (DeepSeek's latent
    attention) and are left to the tensors' own agreement across models."""
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
        elif role.layer is not None and (suffix := name.split(".", 3)[3]) in LAYER_SHAPES and (
                attention or not suffix.startswith("self_attn.")):
            expected = tuple(sizes[k] for k in LAYER_SHAPES[suffix])
        else:
            continue
        if tuple(shapes[name]) != expected:
            raise CheckpointError(f"{where}: tensor {name!r} is {list(shapes[name])} but "
                                  f"config.json's shape fields make it {list(expected)}")


# config.json keys that an output carries over from its sources (architectures/config.py),
# each checked before anything is copied: a value transformers or llama.cpp would choke on,
# or silently misread, must not reach an output
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
                 "decoder_start_token_id")
MAX_TOKEN_ID = 2**31 - 1  # int32: what every tokenizer and GGUF stores
COUNT_KEYS = ("max_position_embeddings", "sliding_window", "max_window_layers")
POSITIVE_FLOAT_KEYS = ("rope_theta", "rope_local_base_freq", "rms_norm_eps", "layer_norm_eps",
                       "partial_rotary_factor")
NON_NEGATIVE_FLOAT_KEYS = ("initializer_range", "attention_dropout")
BOOL_KEYS = ("tie_word_embeddings", "use_cache", "attention_bias", "use_sliding_window",
             "mlp_bias", "norm_topk_prob")
MAPPING_KEYS = ("rope_scaling", "rope_parameters")
MAX_ARCHITECTURES = 8


def check_config_values(config: dict, where: str) -> None:
    """The values of `config` that an output copies (token ids, rope parameters, epsilons,
    flags, dtype, architectures) have the type and range transformers gives them, and no
    number anywhere in it is NaN or infinite; CheckpointError naming `where`/config.json and
    the key otherwise. Absent or null keys are fine."""
    def bad(key: str, value: object, must: str) -> CheckpointError:
        return CheckpointError(f"{where}/config.json: {key} is {repr(value)[:60]}; {must}")

    def is_int(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_number(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    for key, value in _numbers(config, ""):
        if isinstance(value, float) and not math.isfinite(value):
            raise bad(key, value, "every number in config.json must be finite")
    for key in TOKEN_ID_KEYS:
        value = config.get(key)
        ids = value if isinstance(value, list) and 0 < len(value) <= 64 else [value]
        if value is not None and not all(is_int(v) and 0 <= v <= MAX_TOKEN_ID for v in ids):
            raise bad(key, value, f"it must be a token id (an integer from 0 to {MAX_TOKEN_ID}), "
                      "a list of up to 64 of them, or null")
    for key in COUNT_KEYS:
        value = config.get(key)
        if value is not None and not (is_int(value) and 0 <= value <= MAX_TOKEN_ID):
            raise bad(key, value, f"it must be an integer from 0 to {MAX_TOKEN_ID}, or null")
    for key in POSITIVE_FLOAT_KEYS:
        value = config.get(key)
        if value is not None and not (is_number(value) and value > 0):
            raise bad(key, value, "it must be a positive number, or null")
    for key in NON_NEGATIVE_FLOAT_KEYS:
        value = config.get(key)
        if value is not None and not (is_number(value) and value >= 0):
            raise bad(key, value, "it must be a number >= 0, or null")
    for key in BOOL_KEYS:
        value = config.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad(key, value, "it must be true, false or null")
    for key in MAPPING_KEYS:
        value = config.get(key)
        if value is not None and not isinstance(value, dict):
            raise bad(key, value, "it must be an object, or null")
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if value is not None and not (isinstance(value, str) and len(value) < 40 and
                                      isinstance(getattr(torch, value, None), torch.dtype)):
            raise bad(key, value, "it must name a torch dtype (float32, bfloat16, ...), or null")
    value = config.get("architectures")
    if value is not None and not (
            isinstance(value, list) and 0 < len(value) <= MAX_ARCHITECTURES
            and all(isinstance(v, str) and 0 < len(v) <= 200 for v in value)):
        raise bad("architectures", value if not isinstance(value, list) else
                  f"a list of {len(value)} entries",
                  f"it must be a list of 1 to {MAX_ARCHITECTURES} class names")


def _numbers(data: object, where: str):
    """(key path, number) of every number in a JSON document, nested ones too."""
    stack = [(data, where)]
    while stack:
        value, at = stack.pop()
        if isinstance(value, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, float | int) and not isinstance(value, bool):
            yield at, value
