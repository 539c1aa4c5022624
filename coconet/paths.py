"""Where coconet keeps what it writes for a user: one data directory for the results store's default SQLite
file and the topologies measured on the user's machines (``coconet calibrate``), never the installed package.

``$COCONET_DATA_DIR`` overrides the platform's user data dir (``~/.local/share/coconet`` on Linux), so that a
test run, a container or a node of a cluster whose home is shared can keep its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

DATA_DIR_ENV = "COCONET_DATA_DIR"


def data_dir() -> Path:
    """``$COCONET_DATA_DIR``, else the platform's user data dir for coconet."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_data_dir("coconet"))
