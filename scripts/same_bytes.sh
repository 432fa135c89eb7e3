#!/bin/bash
# Same bytes before and after a change that should not change behaviour (a refactor):
#   scripts/same_bytes.sh REV      (REV: the commit to compare the working tree with)
# Builds every bundled toy recipe, then runs extract (dense, --weights, --lora), shrink (merge,
# prune), bake and extend (token_routed, merged_experts) on the outputs, once with REV's code
# and once with the working tree's, on the same toy experts; prints the sha256 of every file
# written that differs, and exits 1 if any does. Needs `moemerge` installed (it runs `demo` for
# the toy experts, cached); ~5 min on 2 cores.
set -euo pipefail
rev=${1:?usage: scripts/same_bytes.sh REV}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'git -C "$here" worktree remove --force "$work/old" >/dev/null 2>&1; rm -rf "$work"' EXIT
git -C "$here" worktree add --detach "$work/old" "$rev" -q
moemerge demo --preset tiny --workdir "$work/demo" >/dev/null 2>&1
cp "$here/moemerge/recipes/toy_camex.yaml" "$work/demo/"

run() {  # run TREE LABEL: every command with TREE's code; hashes to $work/LABEL.sha
  local M="env PYTHONPATH=$1 python -m moemerge" R="$work/run"
  rm -rf "$R" && mkdir "$R" && cd "$work/demo"
  for r in toy_moe toy_merge toy_seq_routed toy_camex; do $M build $r.yaml "$R/$r" -q; done
  $M extract "$R/toy_moe" "$R/x_moe" --expert code
  $M extract "$R/toy_seq_routed" "$R/x_seq" --expert prose
  $M extract "$R/toy_camex" "$R/x_camex" --expert math
  $M extract "$R/toy_camex" "$R/x_camex_w" --weights 0.2,0.3,0.5
  $M extract "$R/toy_moe" "$R/x_lora" --expert code --lora 4 --base toy/base
  $M shrink "$R/toy_moe" "$R/shrunk" --experts 2 --calibration toy/data/code.train.txt \
    --max-tokens 1024 -q
  $M shrink "$R/toy_moe" "$R/pruned" --ratio 0.4 --method prune --no-repair \
    --calibration toy/data/math.train.txt --max-tokens 512 -q
  $M bake "$R/toy_camex" "$R/baked"
  $M extend "$R/toy_moe" "$R/extended" --expert toy/experts/math --name math2 \
    --calibration math2=toy/data/math.train.txt
  $M extend "$R/toy_camex" "$R/extended_camex" --expert toy/experts/code --name code2
  (cd "$R" && find . -type f | sort | xargs sha256sum) > "$work/$2.sha"
}
run "$work/old" before >/dev/null 2>&1
run "$here" after >/dev/null 2>&1
if diff "$work/before.sha" "$work/after.sha"; then
  echo "same bytes: $(wc -l < "$work/after.sha") files written by $rev and by the working tree"
else
  echo "differs (< $rev, > working tree)"; exit 1
fi
