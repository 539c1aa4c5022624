"""Which optional part of coconet (a pip extra) brings which third-party package.

The core (``pip install coconet``: the DSL, schedules, code generation, ``coconet run`` on this machine's
ranks, ``coconet.compile`` with a given schedule, the REST client) needs torch, numpy and a few small
libraries. Tuning, the results store and the service need more, each named by an extra, so that a command
that needs one says which to install rather than failing on an import.
"""

from __future__ import annotations

import importlib.util
import sys
from types import MappingProxyType
from typing import Mapping

from coconet.errors import MissingDependency

STORE = ("sqlalchemy", "alembic")  # what reading or writing the results store imports
# extra -> the top-level modules it installs that coconet imports
EXTRAS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "tune": ("ray", "optuna", *STORE, "scipy"),  # Ray workers, the search, the store, calibration
        # the REST API, the store, the dashboard, /docs and /redoc
        "server": ("fastapi", "uvicorn", *STORE, "plotly", "fastapi_offline"),
        "postgres": ("psycopg",),
        # figures (``coconet bench --plot``, the benchmark scripts): plotly draws, kaleido writes images
        "bench": ("plotly", "kaleido"),
    }
)
# the package pip knows a module by, where the names differ
_DISTRIBUTION = MappingProxyType({"psycopg": "psycopg[binary]", "fastapi_offline": "fastapi-offline"})


def extra_for(module: str | None) -> str | None:
    """The extra that installs ``module`` (a dotted name: its top level counts), or None if none does: the first
    that names it, where several do (plotly: the server's dashboard and the bench's figures)."""
    top = (module or "").split(".")[0]
    return next((extra for extra, mods in EXTRAS.items() if top in mods), None)


def missing(module: str, why: str = "this", extra: str | None = None) -> MissingDependency:
    """The error for an import of ``module`` that failed: which extra installs it (``extra``, where the caller
    knows which of those that install it fits what it was doing), and the pip command."""
    extra = extra or extra_for(module)
    top = module.split(".")[0]
    if extra is None:
        return MissingDependency(
            f"{why} needs {top}, which is not installed: pip install {top}", module=top, extra=None
        )
    return MissingDependency(
        f"{why} needs {_DISTRIBUTION.get(top, top)}, which coconet[{extra}] installs: pip install 'coconet[{extra}]'",
        module=top,
        extra=extra,
    )


def require(modules: tuple[str, ...], why: str, extra: str | None = None) -> None:
    """Raise ``MissingDependency`` for the first of ``modules`` that cannot be imported, naming its extra (or
    ``extra``)."""
    for module in modules:
        if not _importable(module):
            raise missing(module, why, extra)


def _importable(module: str) -> bool:
    if module in sys.modules:  # imported already, or blocked (None), as a test or an embedding host may do
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None
