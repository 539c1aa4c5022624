"""Whether two trees generate the same code: every schedule of every program lowered for one backend by each,
the modules compared byte for byte.

    python benchmarks/same_code.py --rev 1ea590e [--rev .] [--backend nccl] [--step-only] [--out report.json]
                                   [PROGRAM.py ...]

A figure measured on a machine this one is not (a GPU's) was measured on the code some revision generated;
where this checkout generates the same modules, what runs there is what was measured, and where it does not,
the report names each schedule whose code changed. A ``--rev`` is a git revision, a directory holding a tree,
or ``.`` (the working tree, the default second one). Each tree's package is laid out from its own
pyproject.toml and imported in a process of its own, so nothing of this checkout's code lowers the other's.
The programs are this checkout's examples and benchmarks/programs unless named; each tree lowers its own
copy of a program (a program it lacks is reported as such). Exit status 0 when every module the second tree
generates is the first's, byte for byte, else 1.

A module runs the runtime it imports (``coconet.kernels``) too: what is compared is the module with the
runtime's files it imports (and those import), so an edit of a kernel or a collective shows in every module
that calls it. ``--step-only`` compares only what the lowering writes for the schedule: the module from its
first kernel (``_fuse<k>``, ``_chunk<k>``) or ``step`` on, without its header, imports and the runtime (which
trees from before the runtime was ``coconet.kernels`` paste in); ``benchmarks/same_runtime.py`` compares the
runtimes themselves.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("compiled", "eager")

# Run inside a tree's own package: argv is the backend, then the programs' files. Prints
# {program: {schedule text: {kernels: sha256 or "refused: ..."}}} or, for a file the tree lacks, null.
LOWER_ALL = """
import ast, hashlib, importlib.util, json, re, runpy, sys
from pathlib import Path
from coconet.codegen.lower import lower
from coconet.errors import CoconetError
from coconet.schedules.space import generate

# where the schedule's own code begins: its first kernel, or step (no helper of the runtime has those names)
FIRST = re.compile(r"^def (_fuse[0-9]+|_chunk[0-9]+|step)[(]", re.M)


def runtime_of(source):
    # the runtime files the module imports, and those they import (relatively, within coconet.kernels)
    todo = re.findall(r"^from coconet[.]kernels[.]([a-z_]+) import", source, re.M)
    if not todo:
        return ""
    root = Path(importlib.util.find_spec("coconet.kernels").origin).parent
    seen = {}
    while todo:
        m = todo.pop()
        if m not in seen:
            seen[m] = (root / (m + ".py")).read_text()
            todo += [n.module for n in ast.walk(ast.parse(seen[m]))
                     if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module]
    return "".join("\\0" + m + "\\0" + seen[m] for m in sorted(seen))


def what_runs(source):
    if STEP_ONLY:
        return source[FIRST.search(source).start():]
    return source + runtime_of(source)


backend, out = sys.argv[1], {}
for f in sys.argv[2:]:
    if not Path(f).exists():
        out[Path(f).stem] = None
        continue
    modules = out[Path(f).stem] = {}
    for s in generate(runpy.run_path(f)["program"].ir):
        modules[s.text] = row = {}
        for k in KERNELS:
            try:
                row[k] = hashlib.sha256(what_runs(lower(s, backend=backend, kernels=k).source).encode()).hexdigest()
            except CoconetError as e:  # a refusal is part of what the tree generates
                row[k] = f"refused: {type(e).__name__}: {e}"
print(json.dumps(out))
"""


def tree_of(rev: str, scratch: Path) -> Path:
    if rev == ".":
        return ROOT
    if Path(rev).is_dir():
        return Path(rev).resolve()
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True)
    if archive.returncode:
        sys.exit(
            f"same_code: {rev!r} is neither a directory nor a git revision of {ROOT}: {archive.stderr.decode().strip()}"
        )
    dest = Path(tempfile.mkdtemp(prefix="tree_", dir=scratch))
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def package_of(tree: Path, scratch: Path) -> Path:
    """The tree's packages laid out as installed (its pyproject's package-dir), under a folder of their own."""
    config = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = config.get("package-dir", {})
    site = Path(tempfile.mkdtemp(prefix="site_", dir=scratch))
    for pkg in sorted(config["packages"], key=lambda p: p.count(".")):
        # as setuptools finds it: under the folder of its longest mapped prefix (coconet.server.store in server/)
        mapped = max((p for p in dirs if pkg == p or pkg.startswith(p + ".")), key=len, default=None)
        rest = pkg[len(mapped) + 1 :].replace(".", "/") if mapped and pkg != mapped else ""
        src = tree / (dirs[mapped] if mapped else pkg.replace(".", "/")) / rest
        dest = site.joinpath(*pkg.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file():
                shutil.copy2(f, dest / f.name)
    return site


def modules_of(rev: str, programs: list[Path], backend: str, scratch: Path, step_only: bool = False) -> dict:
    tree = tree_of(rev, scratch)
    site = package_of(tree, scratch)
    files = [str(tree / p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in programs]
    script = f"KERNELS = {KERNELS!r}\nSTEP_ONLY = {step_only!r}\n" + LOWER_ALL
    # PYTHONSAFEPATH and a cwd outside every tree: the tree's package is the only coconet importable
    env = dict(os.environ, PYTHONPATH=str(site), PYTHONSAFEPATH="1")
    done = subprocess.run(
        [sys.executable, "-c", script, backend, *files], cwd=scratch, env=env, capture_output=True, text=True
    )
    if done.returncode:
        sys.exit(f"same_code: lowering with {rev!r} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def compare(first: dict, second: dict) -> dict:
    """Per program of the second tree: the schedules whose modules are the first's, those that differ, and
    those the first tree did not generate."""
    report = {}
    for name, theirs in second.items():
        ours = first.get(name)
        if theirs is None:
            report[name] = {"absent_from_second": True}
            continue
        if ours is None:
            report[name] = {"absent_from_first": True, "schedules": len(theirs)}
            continue
        same = [t for t, mods in theirs.items() if ours.get(t) == mods]
        differ = [t for t, mods in theirs.items() if t in ours and ours[t] != mods]
        new = [t for t in theirs if t not in ours]
        report[name] = {
            "schedules": len(theirs),
            "same": len(same),
            "differ": differ,
            "not_in_first": new,
            "gone_from_second": [t for t in ours if t not in theirs],
        }
    return report


def covered(report: dict) -> bool:
    return all(
        not r.get("absent_from_first") and not r.get("differ") and not r.get("not_in_first")
        for r in report.values()
        if not r.get("absent_from_second")
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", action="append", required=True, help="first tree; a second --rev (default .)")
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--step-only", action="store_true", help="compare the schedule's own code alone (the doc)")
    ap.add_argument("programs", nargs="*", type=Path)
    args = ap.parse_args(argv)
    if len(args.rev) > 2:
        ap.error("at most two --rev")
    first, second = (args.rev + ["."])[:2]
    programs = [p.resolve() for p in args.programs] or (
        sorted((ROOT / "examples").glob("*.py")) + sorted((ROOT / "benchmarks/programs").glob("*.py"))
    )
    with tempfile.TemporaryDirectory() as scratch:
        a = modules_of(first, programs, args.backend, Path(scratch), args.step_only)
        b = modules_of(second, programs, args.backend, Path(scratch), args.step_only)
    report = compare(a, b)
    for name, r in report.items():
        if r.get("absent_from_second") or r.get("absent_from_first"):
            print(f"{name:24} not in {second if r.get('absent_from_second') else first}")
            continue
        print(
            f"{name:24} {r['same']:4} of {r['schedules']:4} schedules the same"
            + (f", {len(r['differ'])} differ" if r["differ"] else "")
            + (f", {len(r['not_in_first'])} new" if r["not_in_first"] else "")
            + (f", {len(r['gone_from_second'])} gone" if r["gone_from_second"] else "")
        )
        for t in r["differ"][:3]:
            print(f"    differs: {t}")
    ok = covered(report)
    total = sum(r.get("schedules", 0) for r in report.values() if not r.get("absent_from_first"))
    print(
        f"{'every' if ok else 'NOT every'} module of {second} ({total} schedules x {len(KERNELS)} kernel modes,"
        f" backend {args.backend}) is {first}'s"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "first": first,
                    "second": second,
                    "backend": args.backend,
                    "kernels": KERNELS,
                    "step_only": args.step_only,
                    "every_module_same": ok,
                    "programs": report,
                },
                indent=1,
            )
            + "\n"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
