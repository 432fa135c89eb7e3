"""Bounds on what a recipe, a config or an option may ask for, each checked before any work
and named in its error message (docs/security.md, "Bad input is a clean error"): a hostile
count or length is a clean error, never a hang, a RecursionError or a torch overflow. Light:
no imports, so that every layer can read them.
"""

# Experts of one recipe (per layer): 4x the most llama.cpp loads (1024, finish/gguf.py) and 16x
# the most any released MoE routes (DeepSeek-V3: 256). Also the models of a dense merge, its
# slices and each slice's sources.
MAX_EXPERTS = 4096
MAX_MODELS = 4096

# Stages of a `kind: stages` recipe, and so documents of a mergekit-multi config: each is a
# whole model, built in turn (mergekit-multi configs in the wild chain a handful).
MAX_STAGES = 256

# A recipe (or finetune config, or mergekit config) file: at most this many bytes, and this
# many YAML nodes (values, keys, lists and mappings; all documents together), counted before
# the file is parsed. 4096 experts with names, weights and a few prompts each take ~50,000.
MAX_YAML_BYTES = 4 * 2**20
MAX_YAML_NODES = 100_000

# Tokens per window or block (finetune --seq-len, calibration.seq_len, inspect routing
# --seq-len, build --tune-seq-len) and per prompt (route --max-tokens,
# router.max_prompt_tokens): beyond any model's context. A model's own max_position_embeddings,
# where its config has one, bounds them further (moemerge.loading.check_seq_len).
MAX_SEQ_LEN = 2**20

# Blocks per finetune optimizer step (--batch-size): 16x a large pretraining batch; a step's
# block indices are drawn one by one, so 2^63 - 1 ran for ever.
MAX_BATCH_SIZE = 2**16

# Tokens read per domain (calibration.max_tokens, inspect routing --max-tokens, shrink
# --max-tokens, build --tune-max-tokens).
MAX_TOKENS = 2**40
