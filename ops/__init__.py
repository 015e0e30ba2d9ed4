"""Op modules: importing this package defines every ``torch.ops.scaledmm`` op
and registers the backends that ship with scaledmm."""

import importlib
import logging
import pkgutil

from . import fp8_block  # noqa: F401
from . import fp8  # noqa: F401
from . import nvfp4  # noqa: F401
from . import skinny  # noqa: F401

log = logging.getLogger("scaledmm")

# Kernel backends: every other module of this package, found here (a new
# backend module needs no entry), registers itself.  One whose optional
# dependency (triton, cuda-python) is missing, or that fails to load, leaves
# its family with the other backends; `scaledmm.backends.report()` and
# `BACKEND_LOAD_ERRORS` say why.  Where a backend sits in automatic selection
# is data: scaledmm/tuning/<family>_<arch>.json.
_FAMILY_MODULES = ("fp8_block", "fp8", "nvfp4", "skinny")
BACKEND_MODULES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)
                               if m.name not in _FAMILY_MODULES and not m.name.startswith("_")))
BACKEND_LOAD_ERRORS: dict[str, str] = {}

for _mod in BACKEND_MODULES:
    try:
        importlib.import_module(f"{__name__}.{_mod}")
    except Exception as e:  # noqa: BLE001 - an optional backend must not take the package down
        BACKEND_LOAD_ERRORS[_mod] = f"{type(e).__name__}: {e}"
        level = logging.DEBUG if isinstance(e, ModuleNotFoundError) else logging.WARNING
        log.log(level, "scaledmm: backend module %s not loaded: %s", _mod, e)
