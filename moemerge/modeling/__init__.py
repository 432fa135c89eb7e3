"""Modeling code of the MoE kinds transformers has no class for (seq_routed, bridged).

The files here (all but this one) are shipped next to the weights and loaded by transformers
with trust_remote_code; they import nothing from moemerge.
"""
