"""Whether the runtime a revision pasted into its generated modules is the runtime ``coconet.kernels`` holds:
every helper of that revision's ``codegen/prelude.py`` and ``codegen/shm.py`` compared with the function or
class of the same job in this tree's ``kernels/``, as syntax trees.

    python benchmarks/same_runtime.py --rev main [--out benchmarks/results/same_runtime.json]

Before the runtime was ``coconet.kernels``, the helpers a module called were cut out of those two files and
pasted into it, under ``_`` names; now a module imports them from ``coconet.kernels`` under public names,
bound as the same ``_`` names. A helper is the same where its tree is, once docstrings are dropped, imports
inside functions are dropped (the modules import at their top) and the old names are read as the new ones
(``RENAMED``, and ``_x`` as ``x`` where the new module has an ``x``). Together with
``benchmarks/same_code.py --step-only`` (the schedules' own code) it says that the kernels and collectives a
step runs are the ones it ran. Exit status 0 when every helper is the same, else 1 (the report names each).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# old file -> the modules of kernels/ its helpers went to
HOMES = {
    "codegen/prelude.py": ("context", "collectives", "compiled", "dropout", "ops", "philox"),
    "codegen/shm.py": ("segments", "copier", "shm"),
}
RENAMED = {
    "_AG": "all_gather_into_tensor",
    "_RS": "reduce_scatter_tensor",
    "_words": "dropout_words",
    "_OPS": "OPS",
    "_STREAM_C": "STREAM_C",
    "_cache_dir": "cache_dir",
}
LEFT_OUT = {"HELPERS"}  # the list runtime_text cut helpers out by
LOCAL = {"kernel": {"dispatch": "kernel"}}  # per new function: its local names that were named otherwise


def old_text(rev: str, path: str) -> str:
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    if shown.returncode:
        sys.exit(f"same_runtime: {rev!r} has no {path}: {shown.stderr.strip()}")
    return shown.stdout


def top_level(text: str) -> dict[str, ast.AST]:
    out: dict[str, ast.AST] = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node
    return out


class _Normal(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def _body(self, node):
        body = node.body
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            body = body[1:]
        node.body = body or [ast.Pass()]
        if hasattr(node, "name"):
            node.name = self.names.get(node.name, node.name)
        return self.generic_visit(node)

    visit_FunctionDef = visit_ClassDef = _body

    def visit_Import(self, node):
        return None  # where a module imports a name is not what runs

    visit_ImportFrom = visit_Import

    def visit_Name(self, node):
        node.id = self.names.get(node.id, node.id)
        return node


def normal(node: ast.AST, names: dict[str, str]) -> str:
    return ast.dump(_Normal(names).visit(node), annotate_fields=False, include_attributes=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", required=True, help="a revision whose generated modules carried the runtime")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    report: dict[str, dict] = {}
    new = {m: top_level((ROOT / "kernels" / f"{m}.py").read_text()) for ms in HOMES.values() for m in ms}
    new_names = {n for defs in new.values() for n in defs}
    olds = {f: top_level(old_text(args.rev, f)) for f in HOMES}
    names = {
        o: RENAMED.get(o) or (o[1:] if o.startswith("_") and o[1:] in new_names else o)
        for old in olds.values()
        for o in old
    } | RENAMED
    for old_file, homes in HOMES.items():
        for o, node in olds[old_file].items():
            if o in LEFT_OUT:
                continue
            target = names[o]
            home = next((m for m in homes if target in new[m]), None)
            key = f"{old_file}:{o}"
            if home is None:
                report[key] = {"same": False, "why": f"no {target} in kernels/{{{','.join(homes)}}}.py"}
                continue
            same = normal(node, names) == normal(new[home][target], {**names, **LOCAL.get(target, {})})
            report[key] = {"as": f"coconet.kernels.{home}.{target}", "same": same}
    differ = [k for k, r in report.items() if not r["same"]]
    for k in differ:
        print(f"differs: {k} -> {report[k].get('as') or report[k]['why']}")
    print(f"{len(report) - len(differ)} of {len(report)} helpers of {args.rev} are coconet.kernels' as they stand")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "rev-parse", args.rev], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        args.out.write_text(
            json.dumps(
                {
                    "rev": args.rev,
                    "commit": commit,
                    "same": len(report) - len(differ),
                    "helpers": len(report),
                    "differ": differ,
                    "helpers_compared": report,
                },
                indent=1,
            )
            + "\n"
        )
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
