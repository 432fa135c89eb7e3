"""The pieces of `moemerge extend`: the recipe copy it reads and writes, the tensors it writes."""
