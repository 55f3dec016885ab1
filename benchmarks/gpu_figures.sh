#!/usr/bin/env bash
# The CUDA checks and figures of docs/performance.md, in one command for a GPU lent for a
# few minutes. Each part writes its log under OUT (default: $OUT, else gpu-figures) and a
# line to OUT/summary.txt. No part runs past the deadline (GPU_FIGURES_SECONDS, default
# 540): each gets the time left, up to its own limit; a part cut short, or not started
# for want of a minute, is named in OUT/remaining.txt, so a second call with those names
# finishes the set.
#
#   benchmarks/gpu_figures.sh [PART ...]        (default: all, in this order of priority)
#     run                   python -m harness run --methods all --device cuda (the default
#                           dataset and protocol); P@1 of each method in run-p1.txt
#     suite                 the CUDA tests: tests/engine/test_gpu_path.py with its slow tests,
#                           the compiled-step tests and every test that skips without CUDA
#     evaluation            bench_evaluation_sop.py --device cuda: the full metric suite on
#                           60,502 x 512 embeddings, and which kNN path ran
#     throughput-METHOD     bench_train_throughput.py on roth2020 (ResNet-50, 224 px, batch
#                           112, bf16, fixed-shape miner) for METHOD: bare, eager, compiled,
#                           then compiled with --cuda-graphs; a profiler table of the compiled
#                           loop (all: plain, agrouping, avsl)
#     rerank                bench_diml_rerank.py --device cuda: DIML's re-ranking, pairs/s
#     sam                   bench_sam.py --device cuda: SAM's step against plain's, images/s
#     pipeline              bench_input_pipeline.py --device cuda: JPEGs decoded at 224 px
#
# DEVICE=cpu (default cuda) runs the same commands on the CPU, to check the script itself.
# Where a wheelhouse .whl/ sits in the checkout (../shared/gpu/wheels.sh), it is installed
# first into a folder on PYTHONPATH (a machine without a package index).
set -u
out=${OUT:-gpu-figures}
device=${DEVICE:-cuda}
deadline=${GPU_FIGURES_SECONDS:-540}
parts=("$@")
if [ ${#parts[@]} -eq 0 ] || [ "${parts[0]}" = all ]; then
  parts=(run suite throughput-plain evaluation throughput-agrouping throughput-avsl rerank sam pipeline)
fi
# Each part's own limit in seconds (less where the deadline is nearer).
declare -A limit=([run]=200 [suite]=240 [evaluation]=150 [rerank]=100 [sam]=90 [pipeline]=150)
for part in "${parts[@]}"; do
  case "$part" in
  run | suite | evaluation | rerank | sam | pipeline) ;;
  throughput-?*) limit[$part]=300 ;;
  *)
    echo "unknown part '$part': expected run, suite, evaluation, throughput-METHOD, rerank, sam or pipeline" >&2
    exit 2
    ;;
  esac
done

mkdir -p "$out"
start=$SECONDS
note() { echo "$*" | tee -a "$out/summary.txt"; }
# `timeout`, remembering in `cut` that a command was stopped at its limit.
limited() {
  timeout "$@"
  local rc=$?
  [ $rc -eq 124 ] && cut=1
  return $rc
}

if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    > "$out/install.txt" 2>&1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/card.csv" 2>&1
# The imports a run needs, then the registered methods: a missing wheel stops here.
(
  python - << 'EOF' || exit 1
import faiss, mlflow, optuna, pytorch_metric_learning, torch
card = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {card}")
print(f"faiss {faiss.__version__} (GPU index: {hasattr(faiss, 'StandardGpuResources')}), "
      f"mlflow {mlflow.__version__}, optuna {optuna.__version__}, pml {pytorch_metric_learning.__version__}")
EOF
  python -m harness methods
) > "$out/env.txt" 2>&1 || {
  note "setup failed (env.txt): $(tail -1 "$out/env.txt")"
  exit 1
}
note "setup: $(head -1 "$out/env.txt")"
store=$(mktemp -d /tmp/gpu-figures.XXXX)
export MLFLOW_TRACKING_URI="sqlite:///$store/mlflow.db" DML_HARNESS_CHECKPOINTS="$store/checkpoints"
export DML_HARNESS_DATA=${DML_HARNESS_DATA:-$store/data}
throughput_args=(--device "$device" --protocol roth2020 --fast
  --set backbone.pretrained=false --set miner.name=distance_weighted_fixed)

run_part() {
  local part=$1 seconds=$2
  case "$part" in
  run)
    limited "$seconds" python -m harness run --methods all --device "$device" --json "$out/run.json" \
      > "$out/run.txt" 2>&1
    local rc=$?
    python - "$out/run.json" > "$out/run-p1.txt" 2>&1 << 'EOF'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"{r['method']:<12} seed {r['seed']}  P@1 {100 * r['metrics']['precision_at_1']:.2f}")
EOF
    note "run exit $rc: $(paste -sd ';' "$out/run-p1.txt")"
    ;;
  suite)
    limited "$seconds" python -m pytest -q -rs -m "slow or not slow" tests/engine/test_gpu_path.py \
      tests/engine/test_compiled_step.py tests/cli/test_one_graph_check.py \
      tests/methods/test_avsl_recipe.py tests/components/test_evaluation_search.py \
      > "$out/suite.txt" 2>&1
    note "suite exit $?: $(tail -1 "$out/suite.txt")"
    ;;
  evaluation)
    limited "$seconds" python benchmarks/bench_evaluation_sop.py --device "$device" --skip-pml \
      --threads "$(nproc)" --json "$out/evaluation.json" > "$out/evaluation.txt" 2>&1
    note "evaluation exit $?: $(grep -E '^\(b\)' "$out/evaluation.txt" | head -1)"
    ;;
  throughput-*)
    local method=${part#throughput-} half=$((seconds / 2)) name flags
    for flags in "" "--cuda-graphs"; do
      name="$method${flags:+-cuda-graphs}"
      limited "$half" python benchmarks/bench_train_throughput.py "${throughput_args[@]}" \
        --method "$method" $flags \
        --profile "$out/$name-profile.txt" > "$out/$name.txt" 2>&1
      note "$name exit $?: $(grep -E '/ bare' "$out/$name.txt" | tr -s ' ' | paste -sd ';')"
    done
    ;;
  rerank)
    limited "$seconds" python benchmarks/bench_diml_rerank.py --device "$device" --json "$out/rerank.json" \
      > "$out/rerank.txt" 2>&1
    note "rerank exit $?: $(grep -iE 'pairs/s' "$out/rerank.txt" | head -2 | paste -sd ';')"
    ;;
  sam)
    limited "$seconds" python benchmarks/bench_sam.py --device "$device" > "$out/sam.txt" 2>&1
    note "sam exit $?: $(grep -iE 'images/s|slowdown' "$out/sam.txt" | paste -sd ';')"
    ;;
  pipeline)
    limited "$seconds" python benchmarks/bench_input_pipeline.py --device "$device" \
      --json "$out/pipeline.json" > "$out/pipeline.txt" 2>&1
    note "pipeline exit $?: $(grep -iE 'images/s' "$out/pipeline.txt" | paste -sd ';')"
    ;;
  esac
}

left=()
for part in "${parts[@]}"; do
  budget=$((deadline - (SECONDS - start)))
  if [ "$budget" -lt 60 ]; then
    left+=("$part")
    continue
  fi
  cut=0
  run_part "$part" $((budget < limit[$part] ? budget : limit[$part]))
  [ $cut -eq 1 ] && left+=("$part")
done
if [ ${#left[@]} -gt 0 ]; then
  echo "${left[*]}" > "$out/remaining.txt"
  note "cut short or not run within the ${deadline} s deadline: ${left[*]} (benchmarks/gpu_figures.sh ${left[*]})"
fi
note "gpu_figures: $((SECONDS - start)) s"
