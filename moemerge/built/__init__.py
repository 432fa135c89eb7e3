"""What moemerge does to a model it has built (or a hub MoE), one package or module per command:
`extend` (new experts joined), `extract` (one expert as a dense model, or its LoRA adapter),
`shrink` (fewer experts per layer), `bake` (CAMEx curvature folded into plain weights)."""
