"""nn.Module layers built on the scaledmm ops."""

from .fp8_block import Fp8BlockLinear  # noqa: F401
from .fp8 import Fp8Linear  # noqa: F401
from .skinny import SkinnyLinear  # noqa: F401
from .nvfp4 import NvFp4Linear  # noqa: F401
from .parallel import ColumnParallelLinear, RowParallelLinear, shard_checkpoint  # noqa: F401
