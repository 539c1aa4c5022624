"""``coconet calibrate``: this machine (or a Ray cluster of alike nodes) measured for the cost model, written as
a topology."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from coconet.cli.common import JSON_OPT, echo_json, writable
from coconet.cli.output import fmt_s
from coconet.errors import CoconetError


def calibrate(
    world: int = typer.Option(2, "--world", min=2, max=64, help="Ranks to time collectives among."),
    output: Optional[Path] = typer.Option(
        None,
        "-o",
        "--output",
        help="Where to write the topology YAML. Default: "
        "local.yaml in the user data dir's topologies/ ($COCONET_DATA_DIR, else "
        "the platform's, e.g. ~/.local/share/coconet), where `--topology local` "
        "reads it; never inside the installed package.",
    ),
    max_log2: int = typer.Option(
        24, "--max-log2", min=6, max=30, hidden=True, help="Largest collective timed: 2^K bytes."
    ),
    repeats: int = typer.Option(10, "--repeats", min=1, hidden=True, help="Samples per size."),
    quick: bool = typer.Option(False, "--quick", hidden=True, help="Small buffers, no compiled kernels (tests)."),
    ray_address: Optional[str] = typer.Option(
        None,
        "--ray-address",
        help="Measure this Ray cluster of alike nodes "
        "instead: everything below within one node, plus the link between "
        "two nodes (alpha and beta of a gloo allreduce across them).",
    ),
    name: Optional[str] = typer.Option(
        None,
        "--name",
        help="The topology's name: `local` (this machine, the "
        "default), or the cluster's with --ray-address (needed there); written "
        "as NAME.yaml in the user data dir's topologies/.",
    ),
    as_json: bool = JSON_OPT,
) -> None:
    """Measure this machine for the cost model: alpha and beta of gloo's allreduce, reduce_scatter and
    all_gather over R local ranks (2^8..2^24 bytes, least squares on the medians), the shm backend's
    collectives (reported; the model prices them as memory traffic plus barriers), memory and cache
    bandwidth, page faults of fresh buffers, dispatch, elementwise and matmul throughput, and overlap.
    Writes the `local` topology with this machine's fingerprint (coconet tune calibrates it on first use, and
    again when the machine's fingerprint changes). With --ray-address, a Ray cluster of alike nodes: the same
    within one node, plus the link between two nodes, written as --name with the cluster's fingerprint."""
    from coconet.tuner.calibrate import HEADER, Settings, default_output
    from coconet.tuner.calibrate import calibrate as run_calibration
    from coconet.tuner.topology import LOCAL, save_topology, to_dict, user_dir

    writable(output, "-o")
    if ray_address and not name:
        raise CoconetError("--ray-address measures a cluster: name its topology (--name NAME)")
    if name is not None and (not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name) or name.endswith(".yaml")):
        raise CoconetError(f"--name {name!r}: letters, digits, '.', '_' and '-', without .yaml")
    if name not in (None, LOCAL) and not ray_address:
        raise CoconetError(f"--name {name}: this machine is `local`; another name is a cluster's (--ray-address)")
    settings = Settings(
        world=world,
        max_log2=max_log2,
        repeats=repeats,
        **({"memory_bytes": 2**22, "compiled": False, "min_log2": min(8, max_log2)} if quick else {}),
    )
    if ray_address:
        from coconet.tuner.calibrate_cluster import calibrate_cluster
        from coconet.tuner.cluster import connect

        connect(ray_address)
        result = calibrate_cluster(settings, str(name))
    else:
        result = run_calibration(settings)
    path = output if output is not None else (user_dir() / f"{name}.yaml" if name else default_output())
    try:
        save_topology(result.topology, path, header=HEADER)
    except OSError as e:
        raise CoconetError(f"cannot write {path}: {e.strerror or e}") from None
    t = result.topology
    if as_json:
        echo_json(
            {
                "path": str(path),
                "seconds": result.seconds,
                "topology": to_dict(t),
                "shm_measured": result.extras,
                "samples": {
                    b: {op: [[n, s] for n, s in pts] for op, pts in ops.items()} for b, ops in result.samples.items()
                },
            }
        )
        return
    rows = _figures(result)
    console = Console(highlight=False)
    table = Table(
        title=f"{t.name} topology: {t.nodes} x {world} ranks, measured in {result.seconds:.0f} s", title_justify="left"
    )
    for col in ("figure", "latency / measured", "rate / model"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"wrote {path}", markup=False)


def _figures(result: Any) -> list[tuple[str, str, str]]:
    """The table's rows: each figure the calibration measured, its latency (or what was measured) and its rate
    (or what the model predicts)."""
    t = result.topology
    rows = [("gloo link (ring step)", f"alpha {fmt_s(t.intra.alpha_s)}", f"{t.intra.bandwidth_GBps:.3g} GB/s")]
    if t.inter is not None:
        rows.append(
            ("gloo link between nodes", f"alpha {fmt_s(t.inter.alpha_s)}", f"{t.inter.bandwidth_GBps:.3g} GB/s")
        )
    for op, fit in t.measured.get("gloo", {}).items():  # the one backend whose collectives a calibration fits
        rows.append(
            (
                f"gloo {op}",
                f"alpha {fmt_s(fit.alpha_s)}",
                f"{1e-9 / fit.beta_s_per_byte:.3g} GB/s" if fit.beta_s_per_byte else "-",
            )
        )
    for op in ("allreduce", "reduce_scatter", "all_gather"):
        x = result.extras
        if f"shm_{op}_bytes" in x:  # the model prices shm collectives as memory traffic: side by side
            rows.append(
                (
                    f"shm {op}, 2^{int(x[f'shm_{op}_bytes']).bit_length() - 1} B",
                    f"measured {fmt_s(x[f'shm_{op}_measured_s'])}",
                    f"model {fmt_s(x[f'shm_{op}_model_s'])}",
                )
            )
    rows += [
        ("shm barrier", fmt_s(t.shm_barrier_s), ""),
        ("memory (per rank, all streaming)", "", f"{t.memory_bandwidth_GBps:.3g} GB/s"),
        ("cache (per rank)", f"{t.cache_bytes / 2**20:.3g} MiB", f"{t.cache_bandwidth_GBps or 0:.3g} GB/s"),
        (
            "fresh buffer (largest)",
            "",
            f"{1e-9 / t.fresh_cost[-1][1]:.3g} GB/s" if t.fresh_cost and t.fresh_cost[-1][1] else "-",
        ),
        ("matmul float32", "", f"{t.matmul_TFLOPS['float32'] * 1e3:.3g} GFLOP/s"),
        ("eager op dispatch", fmt_s(t.launch_s), ""),
        ("compiled kernel call", fmt_s(t.compiled_launch_s), ""),
        (
            "elementwise (compiled / eager)",
            "",
            f"{t.elementwise_Gops or 0:.3g} / {t.eager_elementwise_Gops or 0:.3g} Gop/s",
        ),
        ("overlap of comm and compute", f"{t.overlap:.2f}", ""),
    ]
    return rows
