"""The runtime as generated modules carry it: the text of the helpers in ``coconet.codegen.prelude`` (and, for
the shm backend, ``coconet.codegen.shm``) that a module's code calls, pasted into it so that it runs with torch
alone (docs/architecture.md, "Known debts": a runtime pasted as text).
"""

from __future__ import annotations

import functools
import inspect
import re

from coconet.codegen import prelude, shm


@functools.cache
def _sources(backend: str) -> tuple[list[str], dict[str, str]]:
    """The module-level text every prelude starts with, and each helper's source by name: read once per
    process (inspect.getsource of every helper was nine tenths of a lowering's time)."""
    module = inspect.getsource(prelude)
    # the module-level names the helpers use: from _OPS up to the first helper
    parts = [module[module.index("_OPS = {"): module.index("\n\n\ndef _reduce_op")]]
    helpers = prelude.HELPERS
    if backend == "shm":
        text = inspect.getsource(shm)
        parts.append(text[text.index("# process group -> its _Shm"): text.index("\n\n\nclass _Shm")])
        helpers = prelude.HELPERS + shm.HELPERS
    # philox_words imports torch locally; the generated module imports it at the top already
    return parts, {obj.__name__: inspect.getsource(obj).replace("    import torch\n\n", "").rstrip() for obj in helpers}


def prelude_source(code: str | None = None, backend: str = "gloo") -> str:
    """The helpers ``code`` calls, and the ones they call (all of them without ``code``). For the shm
    backend, the collectives of ``coconet.codegen.shm`` replace the torch.distributed ones."""
    head, sources = _sources("shm" if backend == "shm" else "gloo")
    parts = list(head)
    wanted = set(sources) if code is None else set()
    text = code or ""
    while True:
        # a name is called where it is a whole word: one scan for every word beats a search per helper
        words = set(re.findall(r"\w+", text))
        more = {name for name in sources if name not in wanted and name in words}
        if not more:
            break
        wanted |= more
        text = "\n".join(sources[n] for n in more)
    parts += [sources[name] for name in sources if name in wanted]
    if not re.search(r"\b(_OPS|_AG|_RS)\b", "\n".join(parts[1:])):
        parts.pop(0)  # shm code that never calls torch.distributed's collectives
    return "\n\n\n".join(parts)
