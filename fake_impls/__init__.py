"""Fake (meta) implementations of every op, one module per op module."""

from . import fp8_block  # noqa: F401
from . import fp8  # noqa: F401
from . import nvfp4  # noqa: F401
from . import skinny  # noqa: F401
