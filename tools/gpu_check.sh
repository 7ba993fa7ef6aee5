#!/usr/bin/env bash
# One prepared GPU check, for a bare single-GPU machine with JAX (CUDA) preinstalled; under 8 minutes.
#   1. installs what the CPU requirements add on top of JAX, from ./wheels if present (offline), else the index;
#   2. times one MoE layer in bfloat16: the dropless backends against the dense ceiling and the capacity baseline;
#   3. runs the FP8 GEMMs in every execution the GPU has against the emulation (tools/fp8_gemm_check.py);
#   4. trains the tiny model for 60 steps on the GPU (synthetic data: no dataset packages needed).
# Figures go to stdout and, as files, to $OUT (default: outputs/gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-outputs/gpu-check}
mkdir -p "$OUT"

echo "== devices"
$PY -c "import jax; print(jax.__version__, jax.devices())"

echo "== packages"
missing=$($PY - <<'PYEOF'
import importlib.util
wanted = {"flax": "flax==0.12.8", "optax": "optax==0.2.8", "pydantic": "pydantic==2.13.4", "yaml": "PyYAML==6.0.3",
          "tqdm": "tqdm==4.70.1", "matplotlib": "matplotlib==3.11.2", "tensorboardX": "tensorboardX==2.6.5"}
print(" ".join(pin for module, pin in wanted.items() if importlib.util.find_spec(module) is None))
PYEOF
)
if [ -n "$missing" ]; then
  if [ -d wheels ]; then
    $PY -m pip install --quiet --no-index --find-links wheels $missing
  else
    $PY -m pip install --quiet $missing
  fi
fi

echo "== MoE layer, bfloat16, forward+backward (ratio = dense ceiling time / implementation time)"
timeout 300 $PY tools/bench_moe.py --dtype bfloat16 --json > "$OUT/bench_moe.json"
$PY -c "
import json; r = json.load(open('$OUT/bench_moe.json'))
print(r['device'], r['shape'])
for c in r['cases']:
    print(f\"{c['routing']:>11} {c['impl']:>11} {c['time_s']*1e3:9.2f} ms  ratio {c['ceiling_ratio']:.3f}  dropped {c['dropped_tokens']}\")
"

echo "== FP8 GEMMs against the emulation (forward, input and weight gradient; ratio = bfloat16 GEMM time / case's)"
timeout 180 $PY tools/fp8_gemm_check.py --json > "$OUT/fp8_gemm_check.json" && $PY -c "
import json; r = json.load(open('$OUT/fp8_gemm_check.json'))
print(r['device'], r['shape'])
for c in r['cases']:
    print(c['case'], (f\"{c['time_s']*1e3:.2f} ms ratio {c['bf16_gemm_time_ratio']:.3f} max rel diff {c['max_rel_diff_y_dx_dw']}\" if c['ran'] else c['why']))
"

echo "== deepseek3-tiny, 60 steps"
timeout 240 $PY -m MaxText.train run_name=gpu-check-tiny base_output_directory="$OUT" enable_tensorboard=false \
  dataset_type=synthetic
tail -n 1 "$OUT/gpu-check-tiny/metrics.jsonl"
