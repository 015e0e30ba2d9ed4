"""scaledmm: quantized and low-latency GEMM kernels as torch.library custom ops.

``import scaledmm`` registers every op under ``torch.ops.scaledmm`` (CPU, CUDA
and fake implementations) and every backend that can load.  It changes no
global configuration of torch or Inductor.

Examples
--------
>>> import torch, scaledmm
>>> x = torch.randn(4, 256, dtype=torch.bfloat16)
>>> q, s = torch.ops.scaledmm.per_token_group_quant_fp8(x, 128)
>>> q.dtype, s.shape
(torch.float8_e4m3fn, torch.Size([4, 2]))
"""

from . import backends  # noqa: F401  (core first)
from . import ops  # noqa: F401  (defines the ops, registers backends)
from . import fake_impls  # noqa: F401
from .backends import use_backend
from .dispatch import fp8_block_mm, skinny_linear
from . import layers  # noqa: F401
from .quantize import QuantConfig, quantize_, quantize_report
from .checkpoint import load_quantized
from .model_warmup import warmup

__version__ = "0.1.0"

__all__ = ["backends", "ops", "layers", "use_backend", "fp8_block_mm", "skinny_linear", "compile",
           "quantize_", "QuantConfig", "quantize_report", "load_quantized", "warmup"]


def __getattr__(name):
    # scaledmm.compile imports Inductor; load it only when asked for.
    if name == "compile":
        import importlib

        return importlib.import_module(".compile", __name__)
    raise AttributeError(f"module 'scaledmm' has no attribute {name!r}")
