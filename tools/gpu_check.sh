#!/usr/bin/env bash
# One prepared GPU check, for a bare single-GPU machine with JAX (CUDA) preinstalled; under 9 minutes.
#   1. installs what the CPU requirements add on top of JAX, from ./wheels if present (offline), else the index
#      (for a machine without the network: `pip download --no-deps --only-binary=:all: --python-version 3.12
#      --platform manylinux2014_x86_64 -d wheels pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
#      typing-inspection==0.4.2 tensorboardX==2.6.5`, with the GPU machine's Python version);
#   2. trains the tiny model for 60 steps on the GPU (synthetic data: no dataset packages needed);
#   3. times one MoE layer of DeepSeek-V3's expert shape in bfloat16: the dropless backends against the
#      dense ceiling and the capacity baseline, under balanced, skewed and all-to-one routing;
#   4. trains deepseek3-small for 30 steps: the whole step's tokens/s, TFLOP/s and MFU on this GPU;
#   5. runs the FP8 GEMMs in every execution the GPU has against the emulation (tools/fp8_gemm_check.py);
#   6. checks the attention backends' gradients against plain XLA attention at MLA's head dims, and times them;
#   7. trains the tiny model for 60 steps with quantization=mxfp8 and fp8_blockwise, on the same batches as 2.
# Each section has its own time limit and a failed section does not stop the next; the exit code is
# the number of sections that failed. Figures go to stdout and, as files, to $OUT (default:
# outputs/gpu-check): at most eight files, one folder deep. MOE_SHAPE and ATTENTION_SHAPE replace the
# shape flags of sections 3 and 6 (a CPU rehearsal of this script runs them small).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-outputs/gpu-check}
RUNS=$(mktemp -d)  # the training runs' own folders (config, plot); only their metrics go to $OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
failed=0

section() {  # section NAME SECONDS COMMAND...: run, report how it ended, carry on
  local name=$1 limit=$2
  shift 2
  echo "== $name"
  local start=$SECONDS
  timeout "$limit" bash -c '"$@"' section "$@"  # a child shell: timeout cannot stop a function
  local rc=$?
  [ "$rc" -eq 0 ] || { failed=$((failed + 1)); echo "!! $name failed (exit $rc$([ "$rc" -eq 124 ] && echo ", past ${limit} s"))"; }
  echo "   ($name: $((SECONDS - start)) s)"
}

packages() {
  $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
  local missing
  missing=$($PY - <<'PYEOF'
import importlib.util
wanted = {"flax": "flax==0.12.8", "optax": "optax==0.2.8", "pydantic": "pydantic==2.13.4", "yaml": "PyYAML==6.0.3",
          "tqdm": "tqdm==4.70.1", "matplotlib": "matplotlib==3.11.2", "tensorboardX": "tensorboardX==2.6.5"}
print(" ".join(pin for module, pin in wanted.items() if importlib.util.find_spec(module) is None))
PYEOF
)
  [ -z "$missing" ] && return 0
  echo "installing $missing"
  if [ -d wheels ]; then
    $PY -m pip install --quiet --no-index --find-links wheels $missing
  else
    $PY -m pip install --quiet $missing
  fi
}

train() {  # train NAME CONFIG...: a run on synthetic data, its last metrics line, its metrics kept in $OUT
  local name=$1
  shift
  $PY -m MaxText.train run_name="$name" base_output_directory="$RUNS" enable_tensorboard=false \
    dataset_type=synthetic "$@" || return
  cp "$RUNS/$name/metrics.jsonl" "$OUT/$name.jsonl"
  grep -v '"event"' "$OUT/$name.jsonl" | tail -n 1
}

bench_moe() {  # default: one GPU's share of a DeepSeek-V3 MoE layer, 32 of its experts, D 7168, F 2048, top-8
  # shellcheck disable=SC2086
  $PY tools/bench_moe.py --dtype bfloat16 ${MOE_SHAPE:---tokens 4096 --d-model 7168 --ffn 2048 --experts 32 --top-k 8} \
    --block-rows 128 256 --slow-s 5 --json > "$OUT/bench_moe.json" || return
  $PY -c "
import json; r = json.load(open('$OUT/bench_moe.json'))
print(r['device'], r['shape'])
for c in r['cases']:
    print(f\"{c['routing']:>11} {c['impl']:>14} {c['time_s']*1e3:9.2f} ms  ratio {c['ceiling_ratio']:.3f}  dropped {c['dropped_tokens']}\")
for k in r['skipped']:
    print('skipped', k['impl'], k['reason'])
"
}

fp8_gemms() {
  $PY tools/fp8_gemm_check.py --json > "$OUT/fp8_gemm_check.json" || return
  $PY -c "
import json; r = json.load(open('$OUT/fp8_gemm_check.json'))
print(r['device'], r['shape'], 'bf16 GEMMs', round(r['bf16_s'] * 1e3, 3), 'ms')
for c in r['cases']:
    print(c['case'], (f\"{c['time_s']*1e3:.2f} ms ratio {c['bf16_gemm_time_ratio']:.3f} max rel diff {c['max_rel_diff_y_dx_dw']} {c.get('vs', 'vs emulation')} fp8 kernel {c.get('fp8_kernel', '-')}\" if c['ran'] else c['why']))
"
}

attention() {
  # shellcheck disable=SC2086
  $PY tools/bench_attention.py --backends dot flash cudnn --dtype bfloat16 ${ATTENTION_SHAPE:---seq 4096 --heads 16 --batch 2} \
    --blocks 512 1024 | tee "$OUT/attention.txt"
}

MOE_SHAPE=${MOE_SHAPE:-}; ATTENTION_SHAPE=${ATTENTION_SHAPE:-}
export PY OUT RUNS MOE_SHAPE ATTENTION_SHAPE
export -f packages train bench_moe fp8_gemms attention
section packages 90 packages
section "deepseek3-tiny, 60 steps, bfloat16" 120 train tiny-none steps=60
section "MoE layer, bfloat16, forward+backward (ratio = dense ceiling time / implementation time)" 150 bench_moe
section "deepseek3-small, 30 steps, bfloat16: tokens/s, TFLOP/s and MFU of the whole step" 150 \
  train small model_name=deepseek3-small steps=30
section "FP8 GEMMs against the emulation (forward, input and weight gradient; ratio = bfloat16 GEMM time / case's)" 60 fp8_gemms
section "attention at MLA's head dims, forward+backward (grad_err against dot)" 60 attention
section "deepseek3-tiny, 60 steps, quantization=mxfp8 (emulated on this GPU)" 90 train tiny-mxfp8 steps=60 quantization=mxfp8
section "deepseek3-tiny, 60 steps, quantization=fp8_blockwise" 90 train tiny-fp8_blockwise steps=60 quantization=fp8_blockwise
rm -rf "$RUNS"
echo "== $failed section(s) failed"
exit "$failed"
