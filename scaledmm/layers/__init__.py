"""nn.Module layers built on the scaledmm ops."""

from .fp8_block import Fp8BlockLinear  # noqa: F401
from .fp8 import Fp8Linear  # noqa: F401
