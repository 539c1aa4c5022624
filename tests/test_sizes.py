"""Modules a person can hold and functions that fit a screen (docs/architecture.md): no module of the package
over 600 lines and no function body over 80 (its parameters aside: a CLI command declares its options there).
The Alembic migrations are history, not code one works in, and are left out."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
FOLDERS = ("coconet", "schedules", "codegen", "kernels", "tuner", "server")
MODULE_LINES, BODY_LINES = 600, 80


def _modules() -> list[Path]:
    return [p for d in FOLDERS for p in sorted((ROOT / d).rglob("*.py")) if "migrations" not in p.parts]


def _too_long(name: str, text: str) -> list[str]:
    """What of a module's text is over the limits: the module, and each function by its body's lines."""
    found = [f"{name}: {text.count(chr(10))} lines"] if text.count("\n") > MODULE_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.end_lineno - node.body[0].lineno + 1
            if body > BODY_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {body} lines")
    return found


def test_every_module_and_function_fits():
    modules = _modules()
    assert len(modules) > 100
    found = [line for p in modules for line in _too_long(str(p.relative_to(ROOT)), p.read_text())]
    assert not found, "\n".join(found)


def test_the_measure_counts_a_body_not_its_parameters():
    body = "".join(f"    x{i} = {i}\n" for i in range(BODY_LINES))
    params = "".join(f"    a{i}: int = {i},\n" for i in range(50))
    assert _too_long("m", f"def f(\n{params}):\n{body}") == []
    assert _too_long("m", f"def f():\n{body}    y = 0\n") == ["m:1 f: 81 lines"]
    assert _too_long("m", "x = 1\n" * 601) == ["m: 601 lines"]
