"""`moemerge finetune`: train what a merge could not set (routers, or everything) on text.

config (pydantic TrainConfig) → data (token blocks per domain) → params (what trains) →
loop (one explicit AdamW loop; DDP, or FSDP: sharding) → checkpoint (resumable) → export (a
complete model directory, untrained tensors bitwise unchanged) → report (tables, metrics, plots).
"""
