"""The trainer: the loop (loop.py) and the parts it is built from.

The package is also the Python API's `fastddpm.train(...)` (fastddpm.api.train): once any of its modules is
imported, Python binds `fastddpm.train` to this package, so the package itself is made callable."""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        from fastddpm.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
