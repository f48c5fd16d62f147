#!/usr/bin/env bash
# One command: every mixer x both FFNs x experiment=compare's learning rates on the embedded corpus
# (active parameters matched), every mixer x MQAR widths x the MQAR experiment's learning rates
# (experiment=mqar_quick by default), each over SEEDS, then both reports, each architecture at its
# best lr (compare.py --best-over trainer.lr: mean and min-max over the seeds).
# The defaults are 72 + 72 jobs: hours on 2 CPU cores (docs/studies/ tables ran subsets, with the
# commands beside them).
#   studies/compare.sh [OUT]        (default multirun/compare_all/<date>_<time>)
# Open OUT/report_corpus/compare.md and OUT/report_mqar/compare.md (tables + PNGs next to them).
# Environment (defaults in brackets):
#   MIXER [softmax, then every other registered mixer: softmax is the reference for --match-params]
#   FFN [dense,moe]   (corpus grid)
#   MQAR_FFN [dense]   WIDTHS [64,128]   MQAR_EXPERIMENT [mqar_quick; mqar: 3000 steps, 4 lrs]
#                                                        (MQAR grid: MIXER x WIDTHS x the experiment's lrs)
#   SEEDS [0,1]: seed axis of both grids, e.g. SEEDS=0,1,2
#   LAUNCHER [accelerate with a GPU, else python]   ACCELERATE_CONFIG [accelerate's default]
#   JOBS [2 with the python launcher, else 1]: jobs at once, each on cpu_count/JOBS threads
#   CORPUS_ARGS, MQAR_ARGS: extra train.py overrides, e.g. CORPUS_ARGS="trainer.max_steps=60 logger=none"
# A failed job does not stop anything; the exit status is 1 if any job failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-multirun/compare_all/$(date +%Y-%m-%d_%H-%M-%S)}
if [ -z "${MIXER:-}" ]; then
  MIXER=$(python -c "from runs.config import group_choices; print(','.join(['softmax'] + [m for m in group_choices('mixer') if m != 'softmax']))")
fi
FFN=${FFN:-dense,moe}
MQAR_FFN=${MQAR_FFN:-dense}
WIDTHS=${WIDTHS:-64,128}
MQAR_EXPERIMENT=${MQAR_EXPERIMENT:-mqar_quick}
SEEDS=${SEEDS:-0,1}
if [ -z "${LAUNCHER:-}" ]; then
  LAUNCHER=$(python -c "import torch; print('accelerate' if torch.cuda.is_available() else 'python')")
fi
[ "$LAUNCHER" = python ] && JOBS=${JOBS:-2} || JOBS=${JOBS:-1}
LAUNCH=(--launcher "$LAUNCHER" --jobs "$JOBS")
[ -n "${ACCELERATE_CONFIG:-}" ] && LAUNCH+=(--accelerate-config "$ACCELERATE_CONFIG")
start=$(date +%s)
status=0
# shellcheck disable=SC2086  # *_ARGS are word-split on purpose
python scripts/sweep.py experiment=compare mixer="$MIXER" ffn="$FFN" seed="$SEEDS" ${CORPUS_ARGS:-} \
  --match-params active "${LAUNCH[@]}" --out "$OUT/corpus" || status=1
# shellcheck disable=SC2086
python scripts/sweep.py experiment="$MQAR_EXPERIMENT" mixer="$MIXER" ffn="$MQAR_FFN" model.hidden_size="$WIDTHS" \
  seed="$SEEDS" ${MQAR_ARGS:-} \
  "${LAUNCH[@]}" --out "$OUT/mqar" || status=1
python scripts/compare.py "$OUT/corpus" --best-over trainer.lr --out "$OUT/report_corpus" > /dev/null || status=1
python scripts/compare.py "$OUT/mqar" --best-over trainer.lr --out "$OUT/report_mqar" > /dev/null || status=1
echo "reports: $OUT/report_corpus/compare.md and $OUT/report_mqar/compare.md ($(( $(date +%s) - start ))s in all)"
exit $status
