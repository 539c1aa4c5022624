"""The cost model's predictions for every schedule of the adam and megatron_mlp examples, on the shipped topologies
and the tests' local one, at two sizes each: what ``test_cost_predictions.py`` holds them to. Run as a script to
write them (``python -m tests.tuner.cost_predictions``) after a change meant to move them."""

import json
import runpy
from pathlib import Path

from coconet.schedules.space import generate
from coconet.tuner import cost
from coconet.tuner.topology import load_topology

ROOT = Path(__file__).parents[2]
FIXTURE = Path(__file__).parents[1] / "data" / "cost_predictions.json"
# program -> the sizes it is predicted at
PROGRAMS = {
    "adam": ({"N": 2**16}, {"N": 2**26}),
    "megatron_mlp": ({"B": 4, "S": 512, "H": 1024}, {"B": 8, "S": 2048, "H": 8192}),
}
# topology -> (backend, worlds)
TOPOLOGIES = {
    "cpu-25gbe": ("gloo", (2, 8)),
    "dgx-h100-8": ("nccl", (2, 8)),
    str(ROOT / "tests" / "data" / "local-topology.yaml"): ("shm", (2, 4)),
}


def predictions() -> dict[str, float]:
    out = {}
    for name, sizes in PROGRAMS.items():
        program = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir
        for s in generate(program):
            for topo_name, (backend, worlds) in TOPOLOGIES.items():
                topo = load_topology(topo_name)
                for size in sizes:
                    for world in worlds:
                        key = f"{name} | {s.text} | {Path(topo_name).stem} {backend} x{world} | {size}"
                        out[key] = cost.predict(s, size, topo, backend, world=world).seconds
    return out


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(predictions(), indent=1, sort_keys=True) + "\n")
