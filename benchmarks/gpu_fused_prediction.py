"""Predicted, not measured: what a GPU fused collective for Adam would gain over NCCL allreduce + fused Adam.

    python benchmarks/gpu_fused_prediction.py [--out benchmarks/results/gpu_fused_prediction.json]
        [--plot benchmarks/results/gpu_fused_prediction.png]

For the Adam step (examples/adam.py) at N = 2^20..2^28 float32 on ``dgx-h100-8`` (8 ranks) and
``h100-16node-ib`` (16 nodes x 8 ranks), three things are priced per rank:

(i)   the baseline an engineer writes: the gradient copied into its bucket, ``dist.all_reduce`` on NCCL,
      ``torch.optim.Adam(fused=True)`` over all N (``coconet.codegen.baselines.AdamStep``);
(ii)  the best schedule of the current search space on nccl, as the cost model predicts it
      (``coconet.tuner.cost.predict``), and the best one that leaves w replicated, as (i) and (iii) do;
(iii) a GPU fused collective that does not exist yet (docs/gpu-fused-collective.md): a reduce-scatter
      whose reduce kernel also applies the update to the rank's slice (w, m, v read and written once, on
      N/R elements), then an all-gather of w, moved by the SMs over NVLink through symmetric memory (or
      NCCL's user-buffer-registered kernels across nodes).

(i) and (iii) are modelled here, term by term, from the topology's own figures (link α and bandwidth,
HBM bandwidth, launch cost) so both sides of a ratio stand on the same numbers; each term says where it
comes from. The ratios are what the model predicts at nominal datasheet rates, not what a GPU will do.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import runpy
import sys
from pathlib import Path

from coconet.schedules.space import generate
from coconet.tuner import cost
from coconet.tuner.plots import COLOURS, figure, write_figure
from coconet.tuner.topology import Topology, load_topology

ROOT = Path(__file__).resolve().parents[1]
TOPOLOGIES = ("dgx-h100-8", "h100-16node-ib")
EXPONENTS = tuple(range(20, 29))
ITEM = 4  # float32: w, m, v and g are all float32 in examples/adam.py


def _ring(alpha: float, beta: float, steps: int, parts: int, nbytes: float) -> float:
    """A ring reduce-scatter or all-gather of ``nbytes`` among ``parts`` ranks: ``steps`` α-latencies and
    (parts-1)/parts of the buffer over the link (the α-β of coconet.tuner.cost.collective_time)."""
    return steps * alpha + (parts - 1) / parts * nbytes * beta


def baseline(topo: Topology, world: int, n: int) -> dict[str, float]:
    """(i) copy + NCCL allreduce + Adam(fused=True), per rank. The allreduce as the cost model prices it
    (``cost.collective_time``: the better of ring and tree over the slowest link the ranks cross)."""
    S = n * ITEM
    hbm = topo.memory_beta  # topology: memory_bandwidth_GBps (H100 SXM5 datasheet, HBM3 3.35 TB/s)
    return {
        # AdamStep: param.grad.copy_(g): read g, write the bucket; one launch (topology launch_s)
        "copy_g": 2 * S * hbm + topo.launch_s,
        # cost.collective_time: α per ring/tree step (NCCL tuning.cc latencies), bytes at link bandwidth
        "allreduce": cost.collective_time("allreduce", S, topo, "nccl", world),
        # Adam(fused=True) over all N: reads g, w, m, v and writes w, m, v (7 streams), one launch
        "adam_full": 7 * S * hbm + topo.launch_s,
    }


def baseline_rails(topo: Topology, n: int) -> dict[str, float]:
    """(i) with the allreduce as a hierarchical NCCL run across nodes: reduce-scatter inside the node over
    NVLink, an allreduce of each rank's 1/L among the n ranks of its rail (every GPU has its own NIC, so
    the L rails run at once), all-gather inside the node. The cost model's collective_time runs the flat
    ring at the slowest link's rate for all 128 ranks instead, which is the pessimistic bound; this is
    the optimistic one, and the gains below are taken against it so they are not inflated by it."""
    L, nodes = topo.ranks_per_node, topo.nodes
    S = n * ITEM
    a_in, b_in = topo.intra.alpha_s, topo.intra.beta  # topology: links.intra (NVSwitch, NCCL hwLat)
    a_out, b_out = topo.inter.alpha_s, topo.inter.beta  # topology: links.inter (IB NDR, one port per GPU)
    part = S / L
    ring = 2 * _ring(a_out, b_out, nodes - 1, nodes, part)
    tree = 2 * (math.ceil(math.log2(nodes)) * a_out + part * b_out)  # NCCL's tree: up and down
    hbm = topo.memory_beta
    return {
        "copy_g": 2 * S * hbm + topo.launch_s,
        "allreduce": (topo.launch_s + 2 * _ring(a_in, b_in, L - 1, L, S) + min(ring, tree)),
        "adam_full": 7 * S * hbm + topo.launch_s,
    }


def fused_one_node(topo: Topology, n: int, world: int) -> dict[str, dict[str, float]]:
    """(iii) inside one NVSwitch node, R ranks, symmetric memory. Two forms:

    sequential: kernel 1 loads its slice of every peer's g over NVLink (pull), reduces it in registers
    and applies Adam to its slice of w, m, v (the update rides under the loads); kernel 2 stores the new
    w slice into every peer's w (push). pipelined: one kernel that does both on chunks, loads arriving on
    each GPU's inbound NVLink direction while stores leave on the outbound one, so the two overlap.
    Each kernel starts and ends with a barrier over signal pads (one α of the link each).
    """
    R = world
    S = n * ITEM
    a, b = topo.intra.alpha_s, topo.intra.beta  # topology: links.intra, per direction per GPU
    hbm = topo.memory_beta
    launch = topo.launch_s
    # HBM of kernel 1 on this rank: all of its g is read once (its own slice by itself, the others'
    # by peers' loads) plus w, m, v of its slice read and written
    rs_hbm = (S + 6 * S / R) * hbm
    rs_link = (R - 1) / R * S * b  # the slices of R-1 peers come in over NVLink
    ag_link = (R - 1) / R * S * b  # its w slice goes out to R-1 peers
    ag_hbm = (S / R + (R - 1) / R * S) * hbm  # reads its slice once, peers' slices land in its w
    seq = {"rs_update": launch + 2 * a + max(rs_link, rs_hbm), "all_gather_w": launch + 2 * a + max(ag_link, ag_hbm)}
    pipe = {"rs_update_ag": launch + 2 * a + max(rs_link, ag_link, rs_hbm + ag_hbm)}
    # NVLink SHARP (multimem ld_reduce / st through the NVSwitch, torch symmetric memory's multimem
    # kernels): each GPU sends all of g once and its w slice once, receives its reduced slice and all of
    # w: (S + S/R) each way. NCCL's NVLS allreduce moves the same, so the baseline gets it too.
    nvls_link = (S + S / R) * b
    nvls = {"multimem_rs_update_ag": launch + 2 * a + max(nvls_link, rs_hbm + ag_hbm)}
    nvls_base_ar = launch + 2 * a + nvls_link
    return {"sequential": seq, "pipelined": pipe, "nvls": nvls, "nvls_baseline_allreduce": {"allreduce": nvls_base_ar}}


def fused_nodes(topo: Topology, n: int) -> dict[str, dict[str, float]]:
    """(iii) across nodes, per rank, in two forms; the design takes the faster one for the size.

    rail_rs_ag: the node's symmetric-memory reduce-scatter (pull over NVLink), a reduce-scatter of the
    1/L it holds among the n ranks of its rail (NCCL, with the buffer registered: NCCL's own kernel, α
    per ring step of the network), the update of its 1/(nL) slice as its own kernel (the reduce that
    finishes across the network is NCCL's, so the update cannot ride in it), the rail's all-gather of w
    and the node's push all-gather. rail_allreduce: the same, but the rail allreduces its 1/L (NCCL's
    tree: 2·log2(n) network latencies instead of the ring's 2·(n-1)) and every rank of the rail updates
    that 1/L itself, which is cheaper where latency, not bytes, decides."""
    L, nodes = topo.ranks_per_node, topo.nodes
    R = L * nodes
    S = n * ITEM
    a_in, b_in = topo.intra.alpha_s, topo.intra.beta
    a_out, b_out = topo.inter.alpha_s, topo.inter.beta
    hbm = topo.memory_beta
    launch = topo.launch_s
    intra_link = (L - 1) / L * S * b_in
    node_rs = launch + 2 * a_in + max(intra_link, S * hbm)  # all of g read once, peers' slices inbound
    node_ag = launch + 2 * a_in + max(intra_link, S / L * hbm + (L - 1) / L * S * hbm)
    part = S / L
    rail_ar = launch + min(
        2 * _ring(a_out, b_out, nodes - 1, nodes, part), 2 * (math.ceil(math.log2(nodes)) * a_out + part * b_out)
    )
    return {
        "rail_rs_ag": {
            "node_rs": node_rs,
            "rail_rs": launch + _ring(a_out, b_out, nodes - 1, nodes, part),
            "update": launch + 7 * S / R * hbm,
            "rail_ag_w": launch + _ring(a_out, b_out, nodes - 1, nodes, part),
            "node_ag_w": node_ag,
        },
        "rail_allreduce": {
            "node_rs": node_rs,
            "rail_allreduce": rail_ar,
            "update": launch + 7 * part * hbm,
            "node_ag_w": node_ag,
        },
    }


def best_schedules(space, n: int, topo: Topology, world: int) -> dict[str, dict]:
    scored = sorted(
        ((cost.predict(s, {"N": n}, topo, "nccl", world=world).seconds, i, s) for i, s in enumerate(space)),
        key=lambda x: (x[0], x[1]),
    )
    out = {"best": {"schedule": scored[0][2].text, "seconds": scored[0][0]}}
    # as_slice(w) leaves w sharded after the step (no all-gather of w): not the same result as (i)/(iii)
    rep = next((sc, s) for sc, _, s in scored if "as_slice(w)" not in s.text)
    out["best_replicated_w"] = {"schedule": rep[1].text, "seconds": rep[0]}
    return out


def predict_all(topologies=TOPOLOGIES, exponents=EXPONENTS) -> dict:
    program = runpy.run_path(str(ROOT / "examples/adam.py"))["program"]
    space = generate(program)
    result: dict = {
        "source": "model",
        "what": "predicted per-rank step time of Adam with its gradient allreduce; nothing here was measured",
        "program": "examples/adam.py",
        "dtype": "float32",
        "schedules_in_space": len(space),
        "python": platform.python_version(),
        "topologies": {},
    }
    for name in topologies:
        topo = load_topology(name)
        world = topo.world
        rows = []
        for k in exponents:
            n = 2**k
            base = baseline(topo, world, n)
            row: dict = {"N": n, "log2_N": k, "baseline": {"terms": base, "seconds": sum(base.values())}}
            row.update(best_schedules(space, n, topo, world))
            if topo.nodes == 1:
                fused = fused_one_node(topo, n, world)
                nvls_base = {**base, **fused.pop("nvls_baseline_allreduce")}
                row["baseline_nvls"] = {"terms": nvls_base, "seconds": sum(nvls_base.values())}
                row["fused"] = {form: {"terms": t, "seconds": sum(t.values())} for form, t in fused.items()}
                ref = row["baseline"]["seconds"]
                row["gain"] = {
                    "sequential_vs_baseline": ref / row["fused"]["sequential"]["seconds"],
                    "pipelined_vs_baseline": ref / row["fused"]["pipelined"]["seconds"],
                    "nvls_vs_baseline_nvls": row["baseline_nvls"]["seconds"] / row["fused"]["nvls"]["seconds"],
                    "sequential_vs_best_replicated_w": (
                        row["best_replicated_w"]["seconds"] / row["fused"]["sequential"]["seconds"]
                    ),
                }
            else:
                rails = baseline_rails(topo, n)
                row["baseline_rails"] = {"terms": rails, "seconds": sum(rails.values())}
                forms = {form: {"terms": t, "seconds": sum(t.values())} for form, t in fused_nodes(topo, n).items()}
                pick = min(forms, key=lambda k: forms[k]["seconds"])
                row["fused"] = {**forms, "hierarchical": {"form": pick, **forms[pick]}}
                f = row["fused"]["hierarchical"]["seconds"]
                row["gain"] = {
                    "hierarchical_vs_baseline_rails": row["baseline_rails"]["seconds"] / f,
                    "hierarchical_vs_baseline_model": row["baseline"]["seconds"] / f,
                    "hierarchical_vs_best_replicated_w": row["best_replicated_w"]["seconds"] / f,
                }
            rows.append(row)
        result["topologies"][name] = {
            "world": world,
            "nodes": topo.nodes,
            "ranks_per_node": topo.ranks_per_node,
            "figures": {
                "intra": {"alpha_s": topo.intra.alpha_s, "bandwidth_GBps": topo.intra.bandwidth_GBps},
                "inter": (
                    None
                    if topo.inter is None
                    else {"alpha_s": topo.inter.alpha_s, "bandwidth_GBps": topo.inter.bandwidth_GBps}
                ),
                "memory_bandwidth_GBps": topo.memory_bandwidth_GBps,
                "launch_s": topo.launch_s,
            },
            "rows": rows,
        }
    return result


def table(result: dict) -> list[str]:
    lines = []
    for name, t in result["topologies"].items():
        lines.append(f"{name} (world {t['world']}), predicted µs per step:")
        if t["nodes"] == 1:
            lines.append(
                "  N      baseline  best(any)  best(w repl.)  fused seq  fused pipe  | NVLS: base  fused"
                "   gain seq/pipe/nvls"
            )
            for r in t["rows"]:
                f, g = r["fused"], r["gain"]
                lines.append(
                    f"  2^{r['log2_N']:<4} {r['baseline']['seconds'] * 1e6:9.0f} {r['best']['seconds'] * 1e6:10.0f}"
                    f" {r['best_replicated_w']['seconds'] * 1e6:13.0f} {f['sequential']['seconds'] * 1e6:10.0f}"
                    f" {f['pipelined']['seconds'] * 1e6:11.0f}  | {r['baseline_nvls']['seconds'] * 1e6:10.0f}"
                    f" {f['nvls']['seconds'] * 1e6:6.0f}   {g['sequential_vs_baseline']:.2f}x/"
                    f"{g['pipelined_vs_baseline']:.2f}x/{g['nvls_vs_baseline_nvls']:.2f}x"
                )
        else:
            lines.append(
                "  N      baseline(model)  baseline(rails)  best(any)  best(w repl.)  fused hier."
                "  gain vs rails / vs model  (form)"
            )
            for r in t["rows"]:
                g = r["gain"]
                lines.append(
                    f"  2^{r['log2_N']:<4} {r['baseline']['seconds'] * 1e6:16.0f}"
                    f" {r['baseline_rails']['seconds'] * 1e6:16.0f}"
                    f" {r['best']['seconds'] * 1e6:10.0f} {r['best_replicated_w']['seconds'] * 1e6:13.0f}"
                    f" {r['fused']['hierarchical']['seconds'] * 1e6:12.0f}  {g['hierarchical_vs_baseline_rails']:.2f}x"
                    f" / {g['hierarchical_vs_baseline_model']:.2f}x  ({r['fused']['hierarchical']['form']})"
                )
    return lines


def plot(result: dict, path: Path) -> None:
    import plotly.graph_objects as go  # plotly: only when plotting

    names = list(result["topologies"])
    fig = figure(1, len(names), subplot_titles=[f"Adam, {n}, world {result['topologies'][n]['world']}" for n in names])
    dash = {"-": "solid", "--": "dash", ":": "dot"}
    for col, name in enumerate(names, start=1):
        t = result["topologies"][name]
        xs = [r["N"] for r in t["rows"]]
        series = [("baseline: allreduce + Adam(fused)", lambda r: r["baseline"]["seconds"], "black", "-")]
        if t["nodes"] == 1:
            series += [
                ("baseline with NVLS allreduce", lambda r: r["baseline_nvls"]["seconds"], "black", ":"),
                ("fused, sequential", lambda r: r["fused"]["sequential"]["seconds"], COLOURS[0], "-"),
                ("fused, pipelined", lambda r: r["fused"]["pipelined"]["seconds"], COLOURS[0], "--"),
                ("fused, NVLS (multimem)", lambda r: r["fused"]["nvls"]["seconds"], COLOURS[0], ":"),
            ]
        else:
            series += [
                ("baseline, hierarchical on rails", lambda r: r["baseline_rails"]["seconds"], "black", "--"),
                ("fused, hierarchical", lambda r: r["fused"]["hierarchical"]["seconds"], COLOURS[0], "-"),
            ]
        series += [
            ("best schedule today (any)", lambda r: r["best"]["seconds"], COLOURS[1], "-"),
            ("best schedule today, w replicated", lambda r: r["best_replicated_w"]["seconds"], COLOURS[1], "--"),
        ]
        for label, f, colour, style in series:
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=[f(r) * 1e6 for r in t["rows"]],
                    name=f"{label} ({name})" if len(names) > 1 else label,
                    mode="lines+markers",
                    marker={"size": 4},
                    line={"color": colour, "dash": dash[style]},
                ),
                row=1,
                col=col,
            )
        ticks = xs[:: max(1, len(xs) // 8)]  # N is a power of two: ticks say which
        fig.update_xaxes(
            type="log",
            title_text="N (float32 elements)",
            tickvals=ticks,
            ticktext=[f"2<sup>{round(math.log2(n))}</sup>" for n in ticks],
            row=1,
            col=col,
        )
        fig.update_yaxes(type="log", title_text="predicted µs per step (model, not measured)", row=1, col=col)
    write_figure(fig, path, width=int(650 * len(names)) + 250, height=450)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_fused_prediction.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "benchmarks/results/gpu_fused_prediction.png")
    args = ap.parse_args(argv)
    result = predict_all()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    print("\n".join(table(result)))
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
