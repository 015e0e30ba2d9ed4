"""Op modules: importing this package defines every ``torch.ops.scaledmm`` op
and registers the backends that ship with scaledmm."""

import importlib
import logging

from . import fp8_block  # noqa: F401
from . import fp8  # noqa: F401
from . import nvfp4  # noqa: F401
from . import skinny  # noqa: F401

log = logging.getLogger("scaledmm")

# Optional kernel backends: each registers itself; a missing dependency
# (triton, cuda-python) leaves the family with its other backends.
for _mod in ("fp8_block_triton", "fp8_block_cutlass", "nvfp4_triton", "skinny_fused_a"):
    try:
        importlib.import_module(f"{__name__}.{_mod}")
    except ModuleNotFoundError as e:  # module not written yet, or optional dep missing
        if e.name and e.name.startswith(f"{__name__}.{_mod}"):
            continue
        log.debug("scaledmm: backend module %s not loaded: %s", _mod, e)
