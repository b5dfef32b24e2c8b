#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (one H100 or H200, 16 cores): the CUDA tests, GPT-2 124M
# in bf16 (tokens/s and MFU, compiled and not), the lm recipe's default run compiled and not (does compile pay
# at make train's length?), the single-device bench items on CUDA, and the multi-process CPU items (pp, fsdp,
# tp) on 8 cores that nothing else uses. Everything lands in $OUT (a summary, and the logs and run dirs' metrics
# as one tarball); each step has a deadline so that a failing one leaves time to the rest. From the project
# root, after `bash ../shared/gpu/prepare.sh` (device tool: carry [".gpu"]):
#   source .gpu/setup.sh && bash benchmarks/gpu_check.sh 540 [STEP ...]
# With STEPs named (tests, gpt2, profile_tiny, ..., bench_cpu for the background CPU benches), only those run, in
# the script's order: a lease too short for everything is split over calls. The runs so far: BENCHMARKS.md's GPU
# section.
set -u
PY=${PYTHON:-python3}                       # the interpreter with (CUDA) torch
budget=${1:-560}                           # seconds for the whole script
shift; only=" $* "
want() { [[ "$only" == "  " || "$only" == *" $1 "* ]]; }
start=$SECONDS
G=/tmp/gpu_check; mkdir -p "$G"
find "$G" -mindepth 1 -maxdepth 1 ! -name cache -exec rm -rf {} +   # an earlier call's on a warm machine
OUT=${OUT:-$G/out}; mkdir -p "$OUT"
export TRAINER_CACHE_DIR=$G/cache WANDB_MODE=offline PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
GPU_CORES=0-7                              # the GPU runs; the CPU benches get 8-15: no core shared
save() { tar czf "$OUT/results.tgz" -C "$G" --exclude=cache --exclude='*.safetensors' --exclude=checkpoints . 2>/dev/null; }
left() { echo $((budget - (SECONDS - start))); }
step() {  # step NAME MAX_SECONDS CMD...: runs on the GPU cores, logs to $G/NAME.log, never past the budget
  local name=$1 max=$2; shift 2
  want "$name" || return 0
  local t=$(( $(left) - 15 )); (( t > max )) && t=$max
  if (( t < 10 )); then echo "SKIP $name (no time left)" | tee -a "$G/summary.txt"; return; fi
  local t0=$SECONDS
  taskset -c $GPU_CORES timeout -k 5 "$t" "$@" > "$G/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc wall=$((SECONDS - t0))s (limit ${t}s)" | tee -a "$G/summary.txt"
  save
}
lm() {  # lm NAME MAX_SECONDS OVERRIDES...: a training run whose run dir is $G/NAME
  local name=$1 max=$2; shift 2
  step "$name" "$max" "$PY" -m trainer recipe=lm trainer.eval_every=0 trainer.eval_samples=64 \
    checkpoint.save_final=false task.sample_tokens=0 trainer.progress=lines logger=none "$@" "hydra.run.dir=$G/$name"
}
rates() {  # rates NAME: the median tokens/s and MFU over the log windows after the first two (compilation)
  want "$1" || return 0
  "$PY" - "$G/$1" <<'EOF' | tee -a "$G/summary.txt"
import json, statistics, sys
from pathlib import Path
p = Path(sys.argv[1]) / "metrics.jsonl"
ev = [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
w = [e for e in ev if "train/tokens_per_s" in e][2:]
if not w:
    print(f"{p.parent.name}: no windows"); sys.exit()
tps = statistics.median(e["train/tokens_per_s"] for e in w)
mfu = statistics.median(e.get("train/mfu", float("nan")) for e in w)
mem = max(e.get("train/peak_mem_mb", 0) for e in w)
print(f"{p.parent.name}: {tps:,.0f} tokens/s, MFU {mfu:.3f}, peak {mem:,.0f} MiB, windows {len(w)}, "
      f"last loss {[e['train/loss'] for e in ev if 'train/loss' in e][-1]:.3f}")
EOF
}

# From a source tree beside a non-editable install (what setup.sh makes) the tree's trainer/ shadows the installed
# package, which alone maps conf/ and recipes/ in as trainer.conf and trainer.recipes (pyproject's package-dir).
# The links go again at exit, so a checkout this runs in is left as it was.
if ! "$PY" -c "import trainer.conf, trainer.recipes" 2>/dev/null; then
  ln -sn ../conf trainer/conf && ln -sn ../recipes trainer/recipes
  trap 'rm -f trainer/conf trainer/recipes' EXIT
fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  lscpu | grep -E 'Model name|^CPU\(s\)'
  "$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
} 2>&1 | tee "$G/summary.txt"

# The CPU benches in the background, on cores of their own: pp (issue 29) on four, fsdp and tp (issue 33) on four
# others. Each writes its own report (the bench writes one only at the end of all its items); on this machine's
# cores pp's full item took 473 s.
want bench_cpu && ( taskset -c 8-11 timeout $(( budget - 40 )) "$PY" -m benchmarks --only pp --out "$G/bench_pp.md" > "$G/bench_pp.log" 2>&1
  echo "bench_pp rc=$? at $((SECONDS - start))s" >> "$G/summary.txt" ) &
want bench_cpu && ( taskset -c 12-15 timeout $(( budget - 40 )) "$PY" -m benchmarks --only fsdp,tp --out "$G/bench_fsdp_tp.md" \
    > "$G/bench_fsdp_tp.log" 2>&1
  echo "bench_fsdp_tp rc=$? at $((SECONDS - start))s" >> "$G/summary.txt" ) &

# GPT-2 124M's shape (12 x 768, GPT-2's vocabulary padded to 50304) on the byte corpus, bf16, flash SDPA.
GPT2=(model=gpt_medium model.vocab_size=50304 precision=bf16 data.seq_len=1024 data.batch_size=32 optim.lr=6e-4
      trainer.log_every=10)
# The order (the figures of every run so far are in BENCHMARKS.md's GPU sections): GPT-2 124M at llm.c's micro-batch
# (64 x 1024), compiled with inductor's defaults, then with its coordinate-descent tuning of the Triton kernels (the
# elementwise and reduction kernels are ~25 ms of the step: +1.1 points of MFU, minutes of compiling); the batch's
# way to the GPU; the CUDA tests; GPT-2's compile boundary; where the Trainer's extra host time a step on CUDA goes
# (operator calls and kernel launches of both loops, then each part of the step swapped for the hand-written
# loop's); where GPT-2's compiled step spends the GPU's time (its costliest kernels); the loop bench on CUDA; GPT-2
# and the default model through the CLI, compiled and not; last, max_autotune without CUDA graphs (it failed on
# torch 2.11).
B64=("${GPT2[@]}" data.batch_size=64 trainer.compile=true trainer.max_steps=60)
# llm.c's GPT-2 124M batch on one GPU: 8 micro-batches of 64 x 1024 accumulated into one 524,288-token step (its 8
# GPUs take one micro-batch each), so the optimizer step, clipping and zeroing are paid once per 8 micro-batches.
ACC8=("${B64[@]}" trainer.grad_accum_steps=8 trainer.max_steps=16 trainer.log_every=2)
lm gpt2_b64_acc8 100 "${ACC8[@]}"; rates gpt2_b64_acc8
lm gpt2_b64_acc8_cdt 400 "${ACC8[@]}" +trainer.compile_options.coordinate_descent_tuning=true; rates gpt2_b64_acc8_cdt
lm gpt2_b64 100 "${B64[@]}"; rates gpt2_b64
lm gpt2_b64_cdt 255 "${B64[@]}" +trainer.compile_options.coordinate_descent_tuning=true; rates gpt2_b64_cdt
# The batch's way to the GPU: host time per way, and the loop bench's gpt_tiny row with each (benchmarks/h2d.py).
step h2d 150 "$PY" -m benchmarks.h2d ${H2D_ARGS:-}
[ -f "$G/h2d.log" ] && grep -v Warning "$G/h2d.log" | tail -n 12 >> "$G/summary.txt"
step tests 170 "$PY" -m pytest -q -m gpu tests/test_gpu.py tests/test_nonfinite.py -n 3 -p no:cacheprovider -rfEs
[ -f "$G/tests.log" ] && tail -n 25 "$G/tests.log" >> "$G/summary.txt"
# Where torch.compile's boundary goes on GPT-2 124M (the model alone, or with its cross-entropy over 50,304
# logits), hand-written, beside the Trainer's compiled step: in turns in one process.
step gpt2 170 "$PY" -m benchmarks.gpt2
[ -f "$G/gpt2.log" ] && grep -A5 ' medians:' "$G/gpt2.log" >> "$G/summary.txt"
step profile_tiny 40 "$PY" -m benchmarks.profile_steps
step parts_tiny 45 "$PY" -m benchmarks.step_parts --rounds 10 --steps 30
step profile_gpt2 120 "$PY" -m benchmarks.profile_steps --steps 10 --top 10 --kernels 25 "${GPT2[@]}" trainer.compile=true
for f in profile_tiny parts_tiny profile_gpt2; do [ -f "$G/$f.log" ] && grep -v USDT "$G/$f.log" | head -60 >> "$G/summary.txt"; done
step bench_cuda 90 "$PY" -m benchmarks --only loop_tiny,loop_default --out "$G/bench_cuda.md"
lm gpt2_compiled 170 "${GPT2[@]}" trainer.compile=true trainer.max_steps=100; rates gpt2_compiled
lm gpt2_eager 60 "${GPT2[@]}" trainer.max_steps=50; rates gpt2_eager
step profile_default 40 "$PY" -m benchmarks.profile_steps model=gpt_small data.batch_size=8 data.seq_len=256
[ -f "$G/profile_default.log" ] && grep -v USDT "$G/profile_default.log" | head -60 >> "$G/summary.txt"
# The lm recipe's default run (make train: gpt_small, precision=auto), 300 steps: does compile pay on a GPU?
lm default_eager 45 trainer.max_steps=300; rates default_eager
lm default_compiled 80 trainer.compile=true trainer.max_steps=300; rates default_compiled
lm gpt2_b64_autotune 300 "${B64[@]}" trainer.compile_mode=max-autotune-no-cudagraphs; rates gpt2_b64_autotune

wait
for f in bench_cuda bench_pp bench_fsdp_tp; do
  [ -f "$G/$f.md" ] && { echo "== $f"; grep -E '^\|' "$G/$f.md" | head -30; } >> "$G/summary.txt"
done
save; cp "$G/summary.txt" "$OUT/summary.txt"
cat "$G/summary.txt"
