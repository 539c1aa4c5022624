"""The package's layers point down (docs/architecture.md, "Layers"). The import graph of every module of the
package (tests and benchmarks aside) is read with ``ast``, module-level and function-level imports alike, and
checked for four things:

- every import goes from a layer to one it may use (``ALLOWED``);
- no import cycle, neither among module-level imports nor counting the imports inside functions;
- no private name (``_x``) of one package is imported, or read off an imported module, in another;
- a function imports only what is heavy to import (torch, Ray, Optuna, SQLAlchemy, FastAPI, …, or a coconet
  module that imports one of them): what is light is imported at the top. The CLI, whose every command imports
  its own layer when it runs, is exempt.

``test_each_rule_catches_its_violation`` runs the same checks on small trees that break one rule each.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# folder -> package, as [tool.setuptools.package-dir] in pyproject.toml maps them
PACKAGES = {
    "coconet": "coconet",
    "schedules": "coconet.schedules",
    "codegen": "coconet.codegen",
    "kernels": "coconet.kernels",
    "tuner": "coconet.tuner",
    "server": "coconet.server",
}

# module (or package, for all its modules) -> layer; the longest prefix wins
LAYER_OF = {
    "coconet.errors": "errors",
    "coconet.paths": "errors",  # where coconet writes: a leaf every layer may read, as the errors
    "coconet.schedules": "ir",
    "coconet": "dsl",  # the package itself: the DSL's public names and __version__, nothing heavier
    "coconet.loader": "dsl",
    "coconet.kernels": "kernels",
    "coconet.codegen": "codegen",
    "coconet.server": "service",
    "coconet.server.store": "store",
    "coconet.server.leases": "store",
    "coconet.server.keys": "store",
    "coconet.server.records": "store",
    "coconet.server.driver": "store",
    "coconet.server.models": "store",
    "coconet.server.migrations": "store",
    "coconet.tuner": "tuner",
    "coconet.client": "client",
    "coconet.api": "api",
    "coconet.step": "api",
    "coconet.lookup": "api",
    "coconet.optim": "api",
    "coconet.cli": "cli",
    "coconet.__main__": "cli",
}
BELOW_CODEGEN = {"errors", "ir", "dsl", "kernels"}
ALLOWED = {
    "errors": set(),
    "ir": {"errors"},
    "dsl": {"errors", "ir"},
    "kernels": {"errors", "ir"},  # never codegen: the runtime below the lowering
    "codegen": BELOW_CODEGEN,
    "store": {"errors", "ir", "dsl"},  # the tuner uses the store, so the store uses no tuner
    "tuner": BELOW_CODEGEN | {"codegen", "store"},
    "service": BELOW_CODEGEN | {"codegen", "store", "tuner"},
    "client": {"errors", "ir", "dsl"},
    "api": BELOW_CODEGEN | {"codegen", "store", "tuner", "client"},
    "cli": BELOW_CODEGEN | {"codegen", "store", "tuner", "service", "client", "api"},
}
# slow to import: a function may import these (or a coconet module that imports one) to defer them
HEAVY = {
    "torch",
    "ray",
    "optuna",
    "sqlalchemy",
    "alembic",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "scipy",
    "plotly",
    "kaleido",
    "choreographer",  # kaleido's browser driver
    "cupy",
    "triton",
    "tqdm",
}
DEFER_ANYTHING = "coconet.cli"  # the CLI's modules: each command imports its layer when it runs


@dataclass
class Import:
    source: str  # the importing module
    target: str  # the coconet module imported, or the top-level name of another library
    line: int
    in_function: bool
    names: tuple[str, ...] = ()  # for ``from M import a, b``: a, b where M is the target


@dataclass
class Graph:
    modules: dict[str, Path]
    imports: list[Import] = field(default_factory=list)
    private_reads: list[tuple[str, str, str, int]] = field(default_factory=list)  # module, target, name, line


def package_of(module: str) -> str:
    """The package a module belongs to: a subpackage (coconet.codegen, …), or coconet itself."""
    sub = ".".join(module.split(".")[:2])
    return sub if sub in PACKAGES.values() else "coconet"


def layer_of(module: str) -> str | None:
    best = max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len, default=None)
    return LAYER_OF[best] if best else None


def modules_under(root: Path) -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


def build(root: Path) -> Graph:
    g = Graph(modules_under(root))
    for module, path in g.modules.items():
        _read(g, module, ast.parse(path.read_text(), str(path)))
    return g


def _resolve(g: Graph, name: str) -> str:
    while name and name not in g.modules:
        name = name.rpartition(".")[0]
    return name


def _read(g: Graph, module: str, tree: ast.Module) -> None:
    aliases: dict[str, str] = {}  # a name bound to a coconet module of another package -> that module

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for a in child.names:
                    _add(g, module, a.name, child.lineno, in_function, ())
                    if a.asname and a.name.startswith("coconet."):
                        aliases[a.asname] = _resolve(g, a.name)
            elif isinstance(child, ast.ImportFrom) and (child.module or child.level):
                source = _absolute(g, module, child)
                names = []
                for a in child.names:
                    full = f"{source}.{a.name}"
                    if source.startswith("coconet") and _resolve(g, full) == full:  # a module
                        _add(g, module, full, child.lineno, in_function, ())
                        aliases[a.asname or a.name] = full
                    else:
                        names.append(a.name)
                if names:
                    _add(g, module, source, child.lineno, in_function, tuple(names))
            elif isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name):
                target = aliases.get(child.value.id)
                if target and _private(child.attr):
                    g.private_reads.append((module, target, child.attr, child.lineno))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)


def _absolute(g: Graph, module: str, node: ast.ImportFrom) -> str:
    """The module ``from X import`` names, a relative X (the runtime's modules import each other so) made whole."""
    if not node.level:
        return node.module or ""
    base = module if g.modules[module].name == "__init__.py" else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        base = base.rpartition(".")[0]
    return f"{base}.{node.module}" if node.module else base


def _add(g: Graph, module: str, name: str, line: int, in_function: bool, names: tuple[str, ...]) -> None:
    target = _resolve(g, name) if name.split(".")[0] == "coconet" else name.split(".")[0]
    g.imports.append(Import(module, target, line, in_function, names))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _coconet(imp: Import) -> bool:
    return imp.target.split(".")[0] == "coconet"


def layer_violations(g: Graph) -> list[str]:
    out = []
    for imp in filter(_coconet, g.imports):
        src, dst = layer_of(imp.source), layer_of(imp.target)
        if src is None or dst is None:
            out.append(f"{imp.source}:{imp.line} {imp.target}: a module no layer holds (add it to LAYER_OF)")
        elif src != dst and dst not in ALLOWED[src]:
            out.append(f"{imp.source}:{imp.line} imports {imp.target}: layer {src} may not use layer {dst}")
    return out


def cycles(g: Graph, *, in_functions: bool) -> list[list[str]]:
    edges: dict[str, set[str]] = {m: set() for m in g.modules}
    for imp in filter(_coconet, g.imports):
        if imp.target != imp.source and (in_functions or not imp.in_function):
            edges[imp.source].add(imp.target)
    return [c for c in _components(edges) if len(c) > 1]


def _components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def private_imports(g: Graph) -> list[str]:
    out = [
        f"{imp.source}:{imp.line} imports {name} from {imp.target}"
        for imp in filter(_coconet, g.imports)
        for name in imp.names
        if _private(name) and package_of(imp.source) != package_of(imp.target)
    ]
    out += [
        f"{module}:{line} reads {name} of {target}"
        for module, target, name, line in g.private_reads
        if package_of(module) != package_of(target)
    ]
    return out


def light_deferred_imports(g: Graph) -> list[str]:
    heavy = _heavy_modules(g)
    out = []
    for imp in g.imports:
        if not imp.in_function or imp.source == DEFER_ANYTHING or imp.source.startswith(DEFER_ANYTHING + "."):
            continue
        if not (imp.target in HEAVY or imp.target in heavy):
            out.append(f"{imp.source}:{imp.line} imports {imp.target} in a function: light, so import it at the top")
    return out


def _heavy_modules(g: Graph) -> set[str]:
    """The coconet modules whose import imports a library in HEAVY (through their module-level imports)."""
    uses: dict[str, set[str]] = {m: set() for m in g.modules}
    for imp in g.imports:
        if not imp.in_function:
            uses[imp.source].add(imp.target)
    heavy = {m for m, targets in uses.items() if targets & HEAVY}
    grew = True
    while grew:
        more = {m for m, targets in uses.items() if m not in heavy and targets & heavy}
        heavy |= more
        grew = bool(more)
    return heavy


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build(ROOT)


def test_the_folders_are_the_packages_pyproject_maps():
    tomllib = pytest.importorskip("tomllib")
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {k: v for k, v in mapped.items() if k in PACKAGES.values()} == {p: f for f, p in PACKAGES.items()}


def test_layers_point_down(graph):
    assert layer_violations(graph) == []


def test_no_import_cycles(graph):
    assert cycles(graph, in_functions=False) == []
    assert cycles(graph, in_functions=True) == []  # nor one that a function-level import hides


def test_no_private_name_crosses_a_package(graph):
    assert private_imports(graph) == []


def test_functions_import_only_what_is_heavy(graph):
    assert light_deferred_imports(graph) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> Graph:
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return build(tmp_path)


BROKEN = {
    "kernels import codegen": (
        {"kernels/k.py": "from coconet.codegen import lower\n", "codegen/lower.py": ""},
        layer_violations,
    ),
    "codegen imports the tuner": ({"codegen/c.py": "import coconet.tuner.t\n", "tuner/t.py": ""}, layer_violations),
    "the store imports the tuner": (
        {"server/store.py": "from coconet.tuner.t import f\n", "tuner/t.py": "f = 1\n"},
        layer_violations,
    ),
    "a module-level cycle": (
        {"codegen/a.py": "from coconet.codegen import b\n", "codegen/b.py": "from coconet.codegen.a import x\n"},
        lambda g: cycles(g, in_functions=False),
    ),
    "a cycle hidden in a function": (
        {
            "codegen/a.py": "from coconet.codegen import b\n",
            "codegen/b.py": "def f():\n    from coconet.codegen.a import x\n",
        },
        lambda g: cycles(g, in_functions=True),
    ),
    "a private name imported": (
        {"tuner/t.py": "from coconet.codegen.c import _plan\n", "codegen/c.py": ""},
        private_imports,
    ),
    "a private name read": (
        {"tuner/t.py": "from coconet.codegen import c\nc._plan()\n", "codegen/c.py": ""},
        private_imports,
    ),
    "a light import deferred": (
        {"tuner/t.py": "def f():\n    from coconet.schedules import ir\n", "schedules/ir.py": ""},
        light_deferred_imports,
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_each_rule_catches_its_violation(tmp_path, case):
    files, check = BROKEN[case]
    assert check(_tree(tmp_path, files)) != []


def test_the_heavy_deferral_is_allowed(tmp_path):
    g = _tree(
        tmp_path,
        {
            "tuner/t.py": "def f():\n    import torch\n    from coconet.codegen import p\n",
            "codegen/p.py": "import torch\n",
        },
    )
    assert light_deferred_imports(g) == [] and layer_violations(g) == []


if __name__ == "__main__":  # a report of the whole graph: python tests/test_layers.py
    g = build(ROOT)
    for check in (layer_violations, private_imports, light_deferred_imports):
        print(check.__name__, check(g) or "none")
    print("cycles", cycles(g, in_functions=True) or "none")
