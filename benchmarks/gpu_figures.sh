#!/usr/bin/env bash
# The GPU checks and figures of docs/performance.md ("The step compiled whole"), each part
# under 10 minutes on one H100, its output under OUT_DIR (default: $OUT, else gpu-figures):
#   benchmarks/gpu_figures.sh suite       the CUDA suite (tests/engine/test_gpu_path.py, slow
#                                         tests included) and the compiled-step tests
#   benchmarks/gpu_figures.sh throughput METHOD
#                                         bench_train_throughput.py on roth2020 (ResNet-50,
#                                         224 px, batch 112, bf16) for METHOD (plain,
#                                         agrouping): bare, eager and --compile, then
#                                         --cuda-graphs
set -u
usage="usage: benchmarks/gpu_figures.sh suite [OUT_DIR] | throughput METHOD [OUT_DIR]"
part=${1:?$usage}
if [ "$part" = throughput ]; then
  method=${2:?$usage}
  shift
fi
out=${2:-${OUT:-gpu-figures}}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/card.csv" 2>&1
case "$part" in
suite)
  python -m pytest -q -m "slow or not slow" tests/engine/test_gpu_path.py \
    tests/engine/test_compiled_step.py > "$out/suite.txt" 2>&1
  echo "suite exit $?" | tee -a "$out/summary.txt"
  ;;
throughput)
  for flags in "" "--cuda-graphs"; do
    name="$method${flags:+-cuda-graphs}"
    timeout 280 python benchmarks/bench_train_throughput.py --device cuda --protocol roth2020 \
      --set backbone.pretrained=false --fast --method "$method" $flags \
      > "$out/$name.txt" 2>&1
    echo "$name exit $?: $(grep -E '/ bare' "$out/$name.txt" | tr -s ' ' | paste -sd ';')" \
      | tee -a "$out/summary.txt"
  done
  ;;
*) echo "unknown part '$part': expected suite or throughput" >&2; exit 2 ;;
esac
