"""What a collective costs: α-β per link, composed as a network backend's algorithms do (gloo, nccl), or the
memory traffic and barriers of the shm backend's helpers (``coconet.kernels.shm``).
"""

from __future__ import annotations

import math
from typing import Sequence

from coconet.tuner.topology import Topology


def collective_time(
    op: str,
    nbytes: float,
    topo: Topology,
    backend: str,
    world: int,
    between_stages: bool = False,
    crosses_nodes: bool | None = None,
) -> float:
    """Seconds of one collective over a whole buffer of ``nbytes`` among ``world`` ranks on a network
    backend (gloo, nccl): the topology's measured fit, else the best of the backend's algorithms."""
    if world <= 1 and op != "send":
        return 0.0
    fit = topo.fit(backend, op)
    if fit is not None and world == topo.world:
        return fit.time(nbytes)
    if crosses_nodes is None:  # ranks fill nodes in order; a topology's nodes are all there is
        nodes = min(topo.nodes, max(1, -(-world // topo.ranks_per_node)))
    else:
        nodes = 2 if crosses_nodes and topo.nodes > 1 else 1
    intra, inter = topo.intra, topo.inter if nodes > 1 and topo.inter is not None else None
    beta = max(intra.beta, inter.beta) if inter else intra.beta  # a ring or tree moves at its slowest link
    a_in, a_out = intra.alpha_s, (inter.alpha_s if inter else intra.alpha_s)
    launch = topo.launch_s
    if op == "send":
        return launch + (a_out if inter else a_in) + nbytes * beta
    p = world
    best = math.inf
    for alg in topo.algorithms_for(backend, op):
        if op == "allreduce":
            if alg == "ring":
                steps, inter_steps = 2 * (p - 1), 2 * (nodes - 1)
                t = (steps - inter_steps) * a_in + inter_steps * a_out + 2 * (p - 1) / p * nbytes * beta
            elif alg == "tree":  # NCCL: a chain inside each node, a binary tree across nodes, up and down
                per_node = -(-p // nodes)
                t = 2 * ((per_node - 1) * a_in + math.ceil(math.log2(nodes)) * a_out) + 2 * nbytes * beta
            else:  # direct: every rank exchanges with every other at once, twice
                t = 2 * max(a_in, a_out) + 2 * (p - 1) / p * nbytes * beta
        elif op == "reduce_scatter" and alg == "allreduce":  # the whole buffer reduced; each keeps its rows
            t = 2 * (p - nodes) * a_in + 2 * (nodes - 1) * a_out + 2 * (p - 1) / p * nbytes * beta
        elif op in ("reduce_scatter", "all_gather"):
            if alg == "ring":
                t = (p - nodes) * a_in + (nodes - 1) * a_out + (p - 1) / p * nbytes * beta
            else:
                t = max(a_in, a_out) + (p - 1) / p * nbytes * beta
        else:  # broadcast
            if alg == "ring":  # pipelined along a chain
                t = (p - nodes) * a_in + (nodes - 1) * a_out + nbytes * beta
            elif alg == "tree":
                t = math.ceil(math.log2(p)) * (max(a_in, a_out) + nbytes * beta)
            else:  # the root sends to each peer in turn
                t = (p - 1) * (max(a_in, a_out) + nbytes * beta)
        best = min(best, t)
    return launch + best


def shm_collective(op: str, nbytes: float, world: int) -> tuple[float, float, int]:
    """(bytes moved through memory, of which fresh, barriers) per rank for one collective of the shm
    backend over a whole buffer of ``nbytes``, counted from ``coconet.kernels.shm``."""
    R = world
    peers = (R - 1) / R
    if op == "allreduce":
        # publish the peers' rows, reduce own rows out of every segment, copy every rank's rows back
        return (2 * peers + 3 * peers + 2) * nbytes, 0.0, 2
    if op == "reduce_scatter":
        return (2 * peers + 3 * peers) * nbytes, nbytes / R, 1
    if op == "all_gather":
        return (2 / R + 2) * nbytes, nbytes, 1
    if op == "broadcast":
        return 2 * nbytes, 0.0, 1
    return 0.0, 0.0, 1  # a barrier alone


def bucket_launches(sizes: Sequence[float], cap: int) -> list[float]:
    """The bytes of each launch, grouped as ``_launches`` of the generated code groups them."""
    groups: list[float] = []
    size = 0.0
    for n in sizes:
        if groups and size + n > cap:
            groups.append(0.0)
            size = 0.0
        if not groups:
            groups.append(0.0)
        groups[-1] += n
        size += n
    return groups
