"""`python -m moemerge ...` (also what `torchrun -m moemerge finetune ...` runs)."""

from moemerge.cli import app

app(prog_name="moemerge")
