"""A short table of what benchmarks/gpu_checks.sh wrote, printed last by it, so that the run's end says what
it found: the figures of each result file present, and which files are missing.

    python benchmarks/gpu_summary.py OUTDIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def kernels(d: dict) -> list[str]:
    lines = [f"device {d['device']}, torch {d['torch']}, memory peak {d['memory_peak_GBps'] or 'unknown'} GB/s"]
    for r in d["adam"]:
        ours, theirs = r["coconet"], r["torch_adam_fused"]
        lines.append(
            f"adam n=2^{r['n'].bit_length() - 1}: rel err {r['rel_err_vs_float64']:.1e}; kernel alone "
            f"{ours['kernels_fraction_of_peak'] or 0:.0%} of peak vs Adam(fused) "
            f"{theirs['kernels_fraction_of_peak'] or 0:.0%}; speed-up kernel/pipelined/one call "
            + " / ".join(f"{r['speedup_vs_torch_adam_fused'][k]:.2f}x" for k in ("kernels", "pipelined", "single_call"))
        )
    e = d.get("epilogue") or {}
    if e:
        lines.append(
            f"bias+dropout+residual {e['B']}x{e['S']}x{e['H']}: kernel alone "
            f"{e['coconet_compiled']['kernels_fraction_of_peak'] or 0:.0%} of peak vs eager "
            f"{e['torch_eager']['kernels_fraction_of_peak'] or 0:.0%}; speed-up kernel/pipelined/one call "
            + " / ".join(f"{e['speedup_vs_torch_eager'][k]:.2f}x" for k in ("kernels", "pipelined", "single_call"))
            + f"; same mask as uncompiled {e.get('compiled_equals_eager_mask')}, max diff "
            f"{e.get('compiled_vs_eager_max_abs_diff')}, kept {e.get('kept_fraction')}"
        )
    return lines


def kernel_call(d: dict) -> list[str]:
    lines = []
    for p in d["points"]:
        if "standalone_error" in p:
            lines.append(f"n={p['n']}: standalone refused: {p['standalone_error'][:200]}")
        else:
            lines.append(
                f"n={p['n']}: torch.compile {p['torch_compile_s'] * 1e6:.1f} us, standalone "
                f"{p['standalone_s'] * 1e6:.1f} us ({p['ratio']:.2f}x), same results {p['same_results']}"
            )
    return [f"scalars on the {d['scalars']}"] + lines


def bench(d: dict) -> list[str]:
    lines = [f"{d['workload']} world {d['world']} {'/'.join(d['backends'])}, complete {d['complete']}"]
    for p in d["points"]:
        best, torch_row = p["best"], p["torch"] or {}
        ok = sum(r["status"] == "ok" and bool(r["correct"]) for r in p["results"])
        torch_s = (
            f"torch {torch_row['median_s'] * 1e6:.0f} us"
            if torch_row.get("median_s")
            else f"torch {torch_row.get('status')}: {(torch_row.get('error') or '')[:160]}"
        )
        lines.append(
            f"{p['sizes']}: {torch_s}, best {best['median_s'] * 1e6:.0f} us ({p['best_speedup'] or 0:.2f}x; "
            f"{p['best_over_floor'] or 0:.2f}x the floor) {best['schedule']}; {ok}/{len(p['results'])} ok"
            if best
            else f"{p['sizes']}: {torch_s}; no schedule ran ok"
        )
    return lines


def every(path: Path) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    found = [r for r in rows if "schedule" in r]
    bad = [r for r in found if not (r["status"] == "ok" and r["correct"])]
    stopped = [r for r in rows if "schedule" not in r]
    lines = [
        f"{len(found) - len(bad)}/{len(found)} schedules ok in {len({r['program'] for r in found})} programs; "
        f"stopped or not started: {', '.join(r['program'] for r in stopped) or 'none'}"
    ]
    lines += [f"  {r['program']}: {r['schedule'][:70]}  {r['status']}: {(r['error'] or '')[:160]}" for r in bad[:15]]
    return lines


def main(outdir: Path) -> None:
    readers = [
        ("gpu_kernels.json", kernels),
        ("kernel_call_cuda_host_scalars.json", kernel_call),
        ("bench_adam_nccl_w1.json", bench),
        ("bench_megatron_nccl_w1.json", bench),
        ("every_schedule_nccl_eager.jsonl", every),
        ("every_schedule_nccl_compiled.jsonl", every),
    ]
    for name, read in readers:
        path = outdir / name
        print(f"--- {name}")
        if not path.exists():
            print("missing")
            continue
        try:
            lines = read(path) if read is every else read(json.loads(path.read_text()))
        except (KeyError, TypeError, ValueError) as exc:  # a file cut off mid-write still says so
            lines = [f"unreadable: {type(exc).__name__}: {exc}"]
        print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
