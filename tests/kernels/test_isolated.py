"""Every schedule of every example runs from its emitted module in a process where coconet.kernels and torch
are all there is to import: no other coconet package, no site-packages but torch's. One process per example
steps all its schedules (world 1, gloo, eager kernels) and hands back what each step left; the reference
interpreter says what that must be."""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from coconet.codegen.lower import lower
from coconet.schedules import interp
from coconet.schedules.space import generate
from coconet.tuner.launch import Options, free_port
from coconet.tuner.rank import inputs

ROOT = Path(__file__).parents[2]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))
SIZES = {"N": 37, "H": 8, "B": 2, "S": 3, "C": 3, "W": 5, "A": 3, "D": 4}

# run with python -S (no site: no .pth, so no editable install's finder) from the folder holding the copy
CHILD = r"""
import importlib
import importlib.util
import sys

sys.path.append(sys.argv[1])  # torch's site-packages, which holds no coconet
try:
    import coconet.codegen  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("coconet.codegen is importable: the process is not isolated")
import torch
import torch.distributed as dist

for name in ("context", "collectives", "compiled", "dropout", "ops", "segments", "copier", "shm"):
    importlib.import_module("coconet.kernels." + name)  # every runtime module, with torch alone beside it
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
got = []
for job in torch.load(sys.argv[3]):
    spec = importlib.util.spec_from_file_location(job["name"], job["path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tensors = {k: v.clone() for k, v in job["tensors"].items()}
    out = module.step(tensors, job["scalars"], sizes=job["sizes"])
    got.append({"state": {k: tensors[k] for k in job["updates"]}, "outputs": out["outputs"], "sent": out["sent"]})
torch.save(got, sys.argv[4])
dist.destroy_process_group()
print(" ".join(sorted(m for m in sys.modules if m.startswith("coconet"))))
"""


def isolated_tree(tmp: Path) -> Path:
    """A folder holding ``coconet`` as an empty package and a copy of ``coconet.kernels``: nothing else."""
    from coconet.codegen import runtime

    pkg = tmp / "coconet"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    shutil.copytree(runtime.folder(), pkg / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_schedule_runs_with_only_the_runtime_importable(tmp_path, name):
    prog = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))["program"].ir
    sizes = {d: SIZES[d] for d in prog.dims}
    tree = isolated_tree(tmp_path / "tree")
    opts = Options(world=1, sizes=sizes)
    tensors, scalars = inputs(prog, opts, 0, 0, torch.device("cpu"))
    schedules = list(generate(prog))
    jobs = []
    for i, sched in enumerate(schedules):
        path = tree / f"step_{i}.py"
        path.write_text(lower(sched, "gloo", "eager").source)
        jobs.append(
            {
                "name": f"step_{i}",
                "path": str(path),
                "tensors": tensors,
                "scalars": scalars,
                "sizes": sizes,
                "updates": list(prog.updates),
            }
        )
    torch.save(jobs, tmp_path / "jobs.pt")
    site = str(Path(torch.__file__).parents[1])
    done = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            CHILD,
            site,
            str(free_port()),
            str(tmp_path / "jobs.pt"),
            str(tmp_path / "got.pt"),
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = set(done.stdout.split())
    assert {"coconet.kernels.shm", "coconet.kernels.compiled"} <= loaded
    assert not any(m.startswith(("coconet.codegen", "coconet.schedules", "coconet.tuner")) for m in loaded)
    got = torch.load(tmp_path / "got.pt")
    assert len(got) == len(schedules)
    want = interp.run(prog, 1, sizes).observable()  # what the program computes, which every schedule must
    for sched, mine in zip(schedules, got):
        seen = {f"stage0.state.{k}": v for k, v in mine["state"].items()}
        seen |= {f"stage0.output.{k}": v for k, v in mine["outputs"].items()}
        seen |= {f"stage0.sent.{k}": v for k, v in mine["sent"].items()}
        assert set(seen) == set(want), sched.text
        for key, value in want.items():
            np.testing.assert_allclose(
                seen[key].double().numpy(), value, rtol=1e-3, atol=1e-5, err_msg=f"{sched.text}: {key}"
            )


def test_the_runtime_imports_nothing_of_coconet_but_itself():
    """The modules a generated module imports (and what they import) name no other coconet package."""
    from coconet.codegen import runtime

    for backend in ("gloo", "shm"):
        for path in runtime.files(backend):
            text = path.read_text()
            assert "from coconet" not in text.replace("from coconet.kernels", "") and "import coconet" not in text
    assert {p.name for p in runtime.files("shm")} >= {"segments.py", "copier.py", "shm.py", "context.py"}
    assert "shm.py" not in {p.name for p in runtime.files("gloo")}


def test_the_cache_key_changes_with_the_runtime(tmp_path, monkeypatch):
    """A module cached for one runtime is not the one handed out for another: the key carries its digest."""
    from coconet.codegen import runtime
    from coconet.schedules.schedule import Schedule

    prog = runpy.run_path(str(ROOT / "examples" / "sgd.py"))["program"].ir
    before = lower(Schedule(prog), "gloo").path
    copy = tmp_path / "kernels"
    shutil.copytree(runtime.folder(), copy)
    (copy / "collectives.py").write_text((copy / "collectives.py").read_text() + "\n# changed\n")
    monkeypatch.setattr(runtime, "folder", lambda: copy)
    runtime.files.cache_clear()
    runtime.digest.cache_clear()
    try:
        assert lower(Schedule(prog), "gloo").path != before
    finally:
        runtime.files.cache_clear()
        runtime.digest.cache_clear()
    assert json.dumps(sorted(p.name for p in runtime.files("gloo")))  # the real files again
