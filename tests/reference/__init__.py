"""Slow, plainly written forwards of moemerge's own MoE kinds, from the papers and docs/, that
use only torch and the experts' own dense transformers models (loaded from their source
directories); nothing from moemerge.modeling. The shipped code is compared with them."""
