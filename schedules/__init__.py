"""The IR: the DSL, programs and their verification, the reference interpreter, transformations, schedules
and the space of them.

``coconet.schedules`` is also the Python API's ``coconet.schedules(program)`` (the legal schedules of a program,
as ``coconet schedules --json`` lists them): the package's name and the function's are one, so the package is
made callable rather than the function hiding the package.
"""

import importlib
import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, program, *, depth: int = 6):
        # the implementation sits with the rest of the Python API, which reads program files (coconet.loader)
        return importlib.import_module("coconet.api").schedules(program, depth=depth)


sys.modules[__name__].__class__ = _CallablePackage
