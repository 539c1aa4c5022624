"""``coconet calibrate --ray-address``: a topology of a Ray cluster of alike nodes, measured on it.

- Within a node: the whole calibration of ``coconet.tuner.calibrate``, run by a Ray task pinned to one node,
  whose rank processes are that node's, over loopback: its links, collectives' fits, memory, kernels.
- Between nodes: two ranks, one Ray actor on each of two nodes (a ``STRICT_SPREAD`` placement group, as
  ``--placement spread`` places a candidate's ranks), joined by a gloo group over the nodes' addresses; an
  allreduce timed from 2^min to 2^max bytes (the slowest rank's time after a barrier, medians), α and β fitted
  as the loopback link's are, which gives the link between nodes.

The nodes must be alike (one kind of node in the cluster's fingerprint): a topology describes its nodes by one
set of figures. The result is a topology of ``nodes`` × ``world`` ranks on gloo (shm stays within a node), with
the cluster's fingerprint, so that ``--topology NAME`` on this cluster passes its check and on another is refused.
"""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import timedelta
from typing import Any

from coconet.errors import ClusterError, CoconetError
from coconet.tuner.calibrate import Calibration, Settings, calibrate, fit_alpha_beta
from coconet.tuner.fingerprint import detect_cluster, of_nodes
from coconet.tuner.launch import free_port
from coconet.tuner.topology import LOCAL, Link

PLACE_S = 60.0


def calibrate_cluster(settings: Settings, name: str) -> Calibration:
    """Measure the cluster this process is connected to (``coconet.tuner.cluster.connect``) as topology ``name``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if name == LOCAL:
        raise CoconetError("`local` is this machine: name the cluster's topology (--name NAME)")
    nodes = detect_cluster()
    machines = of_nodes(nodes)
    if len(nodes) < 2:
        raise ClusterError(
            f"the Ray cluster has one node ({machines.text()}): `coconet calibrate` without "
            "--ray-address measures a single machine"
        )
    if len(set(nodes.values())) > 1:
        raise ClusterError(
            f"the Ray cluster's nodes differ ({machines.text()}): a topology describes one kind of "
            "node; calibrate a cluster of alike nodes"
        )
    started = time.monotonic()
    # num_cpus=0: the calibration's own rank processes take the node's cores, as they do on one machine
    task = ray.remote(num_cpus=0)(calibrate).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(next(iter(nodes)), soft=False)
    )
    node: Calibration = ray.get(task.remote(settings), timeout=settings.timeout_s + PLACE_S)
    points = _between_nodes(settings)
    fit = fit_alpha_beta(points)
    # two ranks in a ring: T = 2·α + n·β, as the loopback link is read off the allreduce (coconet.tuner.calibrate)
    inter = Link(fit.alpha_s / 2, 1.0 / (max(fit.beta_s_per_byte, 1e-15) * 1e9), "network")
    t = node.topology
    fingerprint = {
        **t.fingerprint,
        "hardware": machines.text(),
        "hardware_hash": machines.digest,
        "nodes": len(nodes),
        "calibration_s": round(time.monotonic() - started, 1),
    }
    topo = dataclasses.replace(
        t,
        name=name,
        nodes=len(nodes),
        inter=inter,
        # gloo is the transport measured between nodes (_Peer); shm's ranks cannot span them
        backends=("gloo",),
        # the collectives' fits are of one node's ranks: across nodes the model composes the two links
        measured={},
        fingerprint=fingerprint,
        description=f"a Ray cluster of {len(nodes)} alike nodes, {t.ranks_per_node} ranks each over gloo, measured "
        "by coconet calibrate --ray-address",
    )
    samples = {**node.samples, "between_nodes": {"allreduce": points}}
    return Calibration(
        topology=topo, samples=samples, extras=node.extras, sweeps=node.sweeps, seconds=time.monotonic() - started
    )


class _Peer:
    """One rank of the between-nodes measurement (wrapped by ray.remote)."""

    def where(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def measure(self, addr: str, port: int, rank: int, sizes: list[int], repeats: int, timeout_s: float) -> list:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=max(60.0, timeout_s)),
        )
        try:
            out = []
            for n in sizes:
                x = torch.ones(max(1, n // 4))
                local = []
                for i in range(2 + repeats):
                    dist.barrier()
                    t0 = time.perf_counter()
                    dist.all_reduce(x)
                    if i >= 2:
                        local.append(time.perf_counter() - t0)
                slowest = torch.tensor(local, dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                s = sorted(slowest.tolist())
                out.append((x.numel() * 4, s[len(s) // 2]))
            return out
        finally:
            dist.destroy_process_group()


def _between_nodes(settings: Settings) -> list[tuple[int, float]]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 1}] * 2, strategy="STRICT_SPREAD")
    actors: list[Any] = []
    try:
        try:
            ray.get(pg.ready(), timeout=PLACE_S)
        except Exception:
            raise ClusterError(
                f"could not place one rank on each of two nodes within {PLACE_S:g} s (each node needs a free CPU)"
            ) from None
        cls = ray.remote(num_cpus=1)(_Peer)
        actors = [
            cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r)
            ).remote()
            for r in range(2)
        ]
        addr, port = ray.get(actors[0].where.remote(), timeout=PLACE_S)
        sizes = [2**k for k in range(settings.min_log2, settings.max_log2 + 1)]
        runs = [
            a.measure.remote(addr, port, r, sizes, settings.repeats, settings.timeout_s) for r, a in enumerate(actors)
        ]
        return ray.get(runs, timeout=settings.timeout_s + PLACE_S)[0]
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(pg)
