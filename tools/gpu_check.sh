#!/usr/bin/env bash
# One prepared GPU check, for a bare single-GPU machine with JAX (CUDA) preinstalled; under 10 minutes.
#   1. installs what the CPU requirements add on top of JAX, from ./wheels if present (offline), else the index
#      (for a machine without the network: `pip download --only-binary=:all: --python-version 3.12
#      --platform manylinux2014_x86_64 -d wheels pydantic==2.13.4 tensorboardX==2.6.5 tokamax==0.0.12`, with the
#      GPU machine's Python version: tokamax brings einshape, jaxtyping, qwix, typeguard, wadler_lindig);
#   2. trains the tiny model for 60 steps on the GPU (synthetic data: no dataset packages needed);
#   3. times one MoE layer at one GPU's share of DeepSeek-V3's on Hopper (expert parallelism 8: 32 experts,
#      4,096 tokens, top-8) in bfloat16: the default backend (tokamax) and blocked against the dense
#      ceiling and the capacity baseline, under balanced, skewed and all-to-one routing;
#   4. the same at the Blackwell recipes' share (expert parallelism 64: 4 experts, 32,768 rows);
#   5. trains deepseek3-small for 30 steps with the default backend, then 6. with blocked: the whole
#      step's tokens/s, TFLOP/s and MFU on this GPU, and their ratio;
#   7. the two small-model runs' steps as tools/aot_compile.py models them for this GPU (the roofline of XLA's
#      schedule), beside their measured step times: what calibrates that model;
#   8. tokamax's grouped GEMMs at the Hopper shape against the dense GEMM, each of the three alone.
# Each section has its own time limit and a failed section does not stop the next; the exit code is
# the number of sections that failed. Figures go to stdout and, as files, to $OUT (default:
# outputs/gpu-check): at most ten files, one folder deep. MOE_SHAPE, MOE_SHAPE_EP64 and GEMM_SHAPE
# replace the shape flags of sections 3, 4 and 8 (a CPU rehearsal of this script runs them small).
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
          "tqdm": "tqdm==4.70.1", "matplotlib": "matplotlib==3.11.2", "tensorboardX": "tensorboardX==2.6.5",
          "tokamax": "tokamax==0.0.12"}
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

bench_moe() {  # bench_moe NAME SHAPE...: one MoE layer's routed part against the dense ceiling
  local name=$1
  shift
  $PY tools/bench_moe.py --dtype bfloat16 "$@" --impls dropless blocked capacity ceiling --block-rows 512 \
    --slow-s 5 --json > "$OUT/$name.json" || return
  $PY -c "
import json; r = json.load(open('$OUT/$name.json'))
print(r['device'], r['shape'])
for c in r['cases']:
    print(f\"{c['routing']:>11} {c['impl']:>22} {c['time_s']*1e3:9.2f} ms  ratio {c['ceiling_ratio']:.3f}  dropped {c['dropped_tokens']}\")
for k in r['skipped']:
    print('skipped', k['impl'], k['reason'])
"
}

mfu_ratio() {  # the two small-model runs' last MFU, and tokamax's over blocked's
  $PY -c "
import json
def last(name):
    rows = [json.loads(l) for l in open('$OUT/' + name + '.jsonl') if '\"event\"' not in l]
    return rows[-1]
a, b = last('small'), last('small-blocked')
print(f\"MFU: default {a['mfu']:.4f}, blocked {b['mfu']:.4f}, ratio {a['mfu'] / b['mfu']:.2f}; tokens/s {a['tokens_per_s']:.0f} vs {b['tokens_per_s']:.0f}\")
"
}

model_vs_run() {  # the small model's step as tools/aot_compile.py models it for this GPU, beside the two runs' times
  local target
  target=$($PY -c "
import jax
kind = jax.devices()[0].device_kind.lower().replace(' ', '')
print(next((t for t in ('gb300', 'gb200', 'b200', 'h200', 'h100') if t in kind), ''))
")
  [ -n "$target" ] || { echo "no compile target for this GPU"; return 1; }
  $PY tools/aot_compile.py --target "$target" --devices 1 model_name=deepseek3-small --json > "$OUT/small_model.json" || return
  $PY tools/aot_compile.py --target "$target" --devices 1 model_name=deepseek3-small moe_matmul=blocked --json \
    > "$OUT/small_blocked_model.json" || return
  $PY -c "
import json, statistics
for run, model in (('small', 'small_model'), ('small-blocked', 'small_blocked_model')):
    rows = [json.loads(l) for l in open('$OUT/' + run + '.jsonl') if '\"event\"' not in l]
    measured = statistics.median(r['step_time_s'] for r in rows[len(rows) // 2:])  # past compilation and warm-up
    m = json.load(open('$OUT/' + model + '.json'))
    o = m['overlap']
    print(f\"{run}: measured {measured:.4f} s per step, modelled {o['step_seconds']:.4f} s \"
          f\"(measured / modelled {measured / o['step_seconds']:.2f}); host round-trips {m['host_syncs']}\")
    c = o['compute']
    print(f\"  kernels per step {c['kernels']:.0f}, iterations of loops the data decides {c['data_dependent_iterations']:.0f}\"
          f\" holding {c['kernels_in_data_dependent_loops']:.0f} kernels\")
    print('  modelled computation by kind:', {k: round(v, 4) for k, v in o['compute']['by_kind'].items()})
"
}

gemms() {  # tokamax's three grouped GEMMs alone against a dense GEMM of the same FLOPs
  # shellcheck disable=SC2086
  $PY tools/bench_grouped_gemm.py ${GEMM_SHAPE:-} --json > "$OUT/grouped_gemm.json" || return
  $PY -c "
import json; r = json.load(open('$OUT/grouped_gemm.json'))
print(r['device'], r['shape'])
for c in r['cases']:
    print(f\"{c['gemm']:>12} {c['kernel']:>7} {c['time_s']*1e3:8.3f} ms  {c['tflops']:7.1f} TFLOP/s  ratio to dense {c['dense_ratio']:.3f}\")
"
}

MOE_SHAPE=${MOE_SHAPE:---tokens 4096 --d-model 7168 --ffn 2048 --experts 32 --top-k 8}
MOE_SHAPE_EP64=${MOE_SHAPE_EP64:---tokens 8192 --d-model 7168 --ffn 2048 --experts 4 --top-k 4 --routings balanced}
GEMM_SHAPE=${GEMM_SHAPE:-}
export PY OUT RUNS GEMM_SHAPE
export -f packages train bench_moe mfu_ratio model_vs_run gemms
section packages 60 packages
section "deepseek3-tiny, 60 steps, bfloat16" 90 train tiny-none steps=60
# shellcheck disable=SC2086
section "MoE layer at Hopper's share, bfloat16, forward+backward (ratio = dense ceiling time / case's)" 120 \
  bench_moe bench_moe $MOE_SHAPE
# shellcheck disable=SC2086
section "MoE layer at the Blackwell recipes' share (4 local experts), forward+backward" 60 \
  bench_moe bench_moe_ep64 $MOE_SHAPE_EP64
section "deepseek3-small, 30 steps, default backend (tokamax): tokens/s, TFLOP/s, MFU" 100 \
  train small model_name=deepseek3-small steps=30
section "deepseek3-small, 30 steps, moe_matmul=blocked (the previous default)" 90 \
  train small-blocked model_name=deepseek3-small steps=30 moe_matmul=blocked
section "deepseek3-small: default over blocked" 10 mfu_ratio
section "deepseek3-small: the compiled step as modelled for this GPU, beside the measured step" 240 model_vs_run
section "tokamax's grouped GEMMs alone, against the dense GEMM" 60 gemms
rm -rf "$RUNS"
echo "== $failed section(s) failed"
exit "$failed"
