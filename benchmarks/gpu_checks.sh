#!/usr/bin/env bash
# Everything that needs a CUDA device, in one run on one GPU, each step under its own time limit: a step
# that fails or runs out of time is reported and the next one runs. The timed steps run alone on the GPU;
# the correctness runs last, several programs at once.
#
#   bash benchmarks/gpu_checks.sh OUTDIR [SECONDS]
#
# SECONDS (default 900) bounds the whole run: the last step, every schedule with compiled kernels, gets
# what the others left. coconet must be importable (`pip install -e .`; where only torch is installed,
# `pip install --no-deps .` does: the checks need numpy, typer, rich and matplotlib beside it, not Ray,
# Optuna, SQLAlchemy or the server's packages). Results: OUTDIR/gpu_kernels.json,
# kernel_call_cuda_host_scalars.json, bench_{adam,megatron}_nccl_w1.{json,png},
# every_schedule_nccl_{eager,compiled}.jsonl; the log on stdout.
set -u
out=${1:?usage: gpu_checks.sh OUTDIR [SECONDS]}
budget=${2:-900}
mkdir -p "$out"
cd "$(dirname "$0")/.."
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

step env 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv;
  $py -c 'import torch, triton, numpy; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
  \"triton\", triton.__version__, \"numpy\", numpy.__version__, torch.cuda.get_device_name())'"
step kernels 200 $py benchmarks/gpu_kernels.py --out "$out/gpu_kernels.json"
# Whether Inductor compiles a chunk standalone (no Dynamo around each call) with the step's scalars on the
# host beside CUDA tensors, as the CPU path does, and what that saves a call
step kernel-call 90 $py benchmarks/kernel_call.py --device cuda --scalars host --size N=2^10 --size N=2^20 \
    --size N=2^24 --out "$out/kernel_call_cuda_host_scalars.json"
step gpu-tests 120 $py -m pytest -q -m gpu --import-mode=append -p no:cacheprovider \
    tests/codegen/test_prelude.py tests/kernels/test_rng.py tests/tuner/test_roofline.py
step every-eager 100 $py benchmarks/every_schedule.py --backend nccl --kernels eager --jobs 12 \
    --deadline-s 85 --out "$out/every_schedule_nccl_eager.jsonl"
step bench-adam 120 $py -m coconet bench examples/adam.py --world 1 --backend nccl --size N=2^26 \
    --schedule all --repeats 20 --warmup 3 --timeout 120 -o "$out/bench_adam_nccl_w1.json" \
    --plot "$out/bench_adam_nccl_w1.png"
step bench-megatron 100 $py -m coconet bench examples/megatron_mlp.py --world 1 --backend nccl \
    --size B=8,S=1024,H=3072 --schedule all --repeats 20 --warmup 3 --timeout 120 \
    -o "$out/bench_megatron_nccl_w1.json" --plot "$out/bench_megatron_nccl_w1.png"
rest=$(left 20)
if [ "$rest" -gt 30 ]; then
    # Inductor compiles in each rank's own process: twelve ranks each with a pool of workers would
    # spend the cores on starting them
    step every-compiled $((rest + 15)) env TORCHINDUCTOR_COMPILE_THREADS=1 $py benchmarks/every_schedule.py \
        --backend nccl --kernels compiled --jobs 12 --deadline-s "$rest" \
        --out "$out/every_schedule_nccl_compiled.jsonl"
else
    echo "=== every-compiled: skipped, $rest s left of the run's $budget"
fi
echo "=== done after $((SECONDS - start)) s"
$py benchmarks/gpu_summary.py "$out"
