"""seq_routed on families whose dense class does more than Llama's (Gemma 2: √d embedding
scaling, final logit softcapping; Gemma 3: q/k norms, local and global rope; Phi-3: fused
projections), distinct experts, against a plain reference: each expert is its own dense
transformers class with the shared embedding and head put in place of its own, and the
sequences are routed and mixed as docs/sequence-routing.md writes it (perplexity router, k = 2).
"""

import copy

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from transformers import CONFIG_MAPPING

from moemerge.api import build
from moemerge.toy.published import published_configs, published_model
from reference.dense import dense, embedding, head
from reference.sequence import mean_nll, routing_weights
from reference.test_seq_routed import shipped_logits

TOLERANCE = 1e-5
TEMPERATURE = 0.5  # top-2 weights of log(1/PPL) scores: far from 0 / 1 and from uniform
SHAPES = {"gemma-2-2b-it": {"sliding_window": 4},
          "gemma-3-1b-pt": {"sliding_window": 4, "sliding_window_pattern": 2},
          "phi-3-mini-4k-instruct": {"sliding_window": 4}}
CASES = [("gemma-2-2b-it", "logits"), ("gemma-2-2b-it", "hidden"),
         ("gemma-3-1b-pt", "logits"), ("phi-3-mini-4k-instruct", "hidden")]
IDS = torch.randint(4, 300, (3, 10), generator=torch.Generator().manual_seed(1))


def experts_of(name: str, root, tokenizer) -> list:
    model_type = published_configs()[name]["model_type"]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers lacks {model_type}")
    base = published_model(name, root / "base", tokenizer=tokenizer, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, vocab_size=300, **SHAPES[name])
    # noise on every tensor: Gemma's zero-initialised (1 + w) norms become non-trivial too
    return [perturbed_copy(base, root / f"e{i}", scale=0.05, seed=20 + i) for i in range(3)]


def softcap(logits: torch.Tensor, config) -> torch.Tensor:
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else cap * torch.tanh(logits / cap)


def reference(dirs: list, how: str) -> torch.Tensor:
    """ids [B, T] -> mixed logits [B, T, V]."""
    sources = [dense(d) for d in dirs]
    shared_embed = torch.stack([embedding(m) for m in sources]).mean(0)
    shared_head = torch.stack([head(m) for m in sources]).mean(0)
    logits, hidden = [], []
    with torch.no_grad():
        for model in sources:
            model = copy.deepcopy(model)
            model.get_input_embeddings().weight.copy_(shared_embed)
            model.get_output_embeddings().weight.copy_(shared_head)  # tied: the same matrix
            out = model(input_ids=IDS, output_hidden_states=True)
            logits.append(out.logits)  # the class's own scaling and softcapping
            hidden.append(out.hidden_states[-1])  # after the final norm
    rows = []
    for b, x in enumerate(IDS):
        scores = torch.stack([-mean_nll(z[b], x) for z in logits])  # log(1/PPL)
        weights = routing_weights(scores, 2, TEMPERATURE)
        if how == "hidden":
            mixed = sum(w * hidden[e][b] for e, w in weights.items())
            rows.append(softcap(mixed @ shared_head.T, sources[0].config))
        else:
            rows.append(torch.logsumexp(torch.stack(
                [torch.log(w) + torch.log_softmax(logits[e][b], -1)
                 for e, w in weights.items()]), dim=0))
    return torch.stack(rows)


@pytest.mark.parametrize(("name", "how"), CASES, ids=lambda c: str(c))
def test_shipped_equals_the_reference(name, how, tokenizer, tmp_path, record):
    dirs = experts_of(name, tmp_path, tokenizer)
    recipe = (f"kind: moe\nassembly: seq_routed\nbase_model: {dirs[0].parent / 'base'}\n"
              f"experts: [{', '.join(map(str, dirs))}]\nexperts_per_sequence: 2\nmix: {how}\n"
              f"router: {{kind: perplexity, temperature: {TEMPERATURE}}}\n"
              "output: {dtype: float32}\n")  # the shared tables as averaged, not in bf16
    build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "moe", progress=False)
    ours, theirs = shipped_logits(tmp_path / "moe", IDS), reference(dirs, how)
    assert record((ours - theirs).abs().max()) <= TOLERANCE
