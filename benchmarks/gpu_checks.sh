#!/usr/bin/env bash
# Everything that needs a CUDA device, in one run on one GPU, each step under its own time limit: a step
# that fails or runs out of time is reported and the next one runs. Steps run in order of what the issue's
# targets need first (the kernel figures, the whole-step benchmarks), then the CUDA tests, then breadth
# (every schedule on CUDA); the timed steps run alone on the GPU.
#
#   bash benchmarks/gpu_checks.sh OUTDIR [SECONDS]
#
# SECONDS (default 540) bounds the whole run, so that it ends inside a 10-minute command limit with time
# to spare; a step gets at most its own limit and never more than the run has left, and one with under
# 20 s left is skipped and named. coconet must be importable (`pip install -e .`; where only torch is
# installed, `pip install --no-deps .` does: the checks need numpy, typer, rich, plotly and pytest
# beside it, not Ray, Optuna, SQLAlchemy or the server's packages). Results: OUTDIR/gpu_kernels.json,
# bench_{adam,megatron}_nccl_w1.{json,html} (the figures as pages: a PNG would need a Chromium there),
# gpu_tests.xml, cuda_gloo_w{2,3}.xml, kernel_call_cuda_host_scalars.json,
# every_schedule_nccl_{eager,compiled}.jsonl, targets.json (each target met or not, from those files); the
# log on stdout. OUTDIR is meant to be benchmarks/results/<gpu>/.
# NCCL with more than one rank needs a GPU per rank: tests/codegen/test_cuda_gloo.py's skip reason gives
# the command for a multi-GPU machine.
set -u
out=${1:?usage: gpu_checks.sh OUTDIR [SECONDS]}
budget=${2:-540}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
py=${PYTHON:-python3}
# Run from the checkout, `python -m` would find the folder coconet/ (the package's top level only) before
# the installed package: the ranks, started with -m, must import the installed one.
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
start=$SECONDS

left() { echo $((budget - (SECONDS - start) - ${1:-0})); }

step() {
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    [ "$limit" -gt "$(left)" ] && limit=$(left)
    if [ "$limit" -lt 20 ]; then
        echo "=== $name: skipped, $(left) s left of the run's $budget"
        return
    fi
    echo "=== $name (limit ${limit} s, $((SECONDS - start)) s into the run)"
    timeout -k 10 "$limit" "$@"
    rc=$?
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

step env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  $py -c 'import torch, triton, numpy; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
  \"triton\", triton.__version__, \"numpy\", numpy.__version__, torch.cuda.get_device_name())'"
# fused Adam kernel 2^22..2^27 and the Megatron epilogue against HBM peak (targets: >= 80%)
step kernels 100 "$py" benchmarks/gpu_kernels.py --out "$out/gpu_kernels.json"
# the whole step against all_reduce + Adam(fused=True) at the two target sizes (>= 1.5x at 2^24, 1.0x at 2^20)
step bench-adam 120 "$py" -m coconet bench examples/adam.py --world 1 --backend nccl --size N=2^24 --size N=2^20 \
    --schedule all --repeats 20 --warmup 3 --timeout 120 -o "$out/bench_adam_nccl_w1.json" \
    --plot "$out/bench_adam_nccl_w1.html"
step bench-megatron 80 "$py" -m coconet bench examples/megatron_mlp.py --world 1 --backend nccl \
    --size B=8,S=1024,H=3072 --schedule all --repeats 20 --warmup 3 --timeout 120 \
    -o "$out/bench_megatron_nccl_w1.json" --plot "$out/bench_megatron_nccl_w1.html"
# the CUDA tests that are not the breadth runs below; the NCCL tests across GPUs skip here, saying why
step gpu-tests 60 "$py" -m pytest -q -m gpu --import-mode=append -p no:cacheprovider -rs \
    --junitxml="$out/gpu_tests.xml" tests/kernels/test_runtime.py tests/kernels/test_rng.py \
    tests/tuner/test_roofline.py tests/codegen/test_cuda_gloo.py -k "not on_cuda_tensors_over_gloo"
# every schedule of every example and benchmark program at world 2 and 3 on CUDA tensors over gloo, one
# GPU: the two worlds at once (each rank a process of its own; the GPU is not the bottleneck here)
cuda_gloo() {
    local w pids=() rc=0
    for w in 2 3; do
        "$py" -m pytest -q -m gpu --import-mode=append -p no:cacheprovider --junitxml="$out/cuda_gloo_w$w.xml" \
            tests/codegen/test_cuda_gloo.py -k "on_cuda_tensors_over_gloo and w$w" > "$out/cuda_gloo_w$w.log" 2>&1 &
        pids+=($!)
    done
    for w in "${pids[@]}"; do wait "$w" || rc=1; done
    tail -n 5 "$out"/cuda_gloo_w*.log
    return $rc
}
# timeout runs a program, not a function: the step is a bash that has the function (timeout signals the
# whole process group, so the ranks of both worlds stop with it)
export -f cuda_gloo
export py out
step cuda-gloo 150 bash -c cuda_gloo
# Whether Inductor compiles a chunk standalone (no Dynamo around each call) with the step's scalars on the
# host beside CUDA tensors, and what that saves a call
step kernel-call 45 "$py" benchmarks/kernel_call.py --device cuda --scalars host --size N=2^20 --size N=2^24 \
    --out "$out/kernel_call_cuda_host_scalars.json"
rest=$(left 20)
if [ "$rest" -gt 30 ]; then
    step every-eager "$((rest + 15))" "$py" benchmarks/every_schedule.py --backend nccl --kernels eager --jobs 12 \
        --deadline-s "$rest" --out "$out/every_schedule_nccl_eager.jsonl"
else
    echo "=== every-eager: skipped, $rest s left of the run's $budget"
fi
rest=$(left 20)
if [ "$rest" -gt 30 ]; then
    # Inductor compiles in each rank's own process: twelve ranks each with a pool of workers would
    # spend the cores on starting them
    step every-compiled "$((rest + 15))" env TORCHINDUCTOR_COMPILE_THREADS=1 "$py" benchmarks/every_schedule.py \
        --backend nccl --kernels compiled --jobs 12 --deadline-s "$rest" \
        --out "$out/every_schedule_nccl_compiled.jsonl"
else
    echo "=== every-compiled: skipped, $rest s left of the run's $budget"
fi
echo "=== done after $((SECONDS - start)) s"
"$py" benchmarks/gpu_summary.py "$out"
"$py" benchmarks/gpu_targets.py "$out"
