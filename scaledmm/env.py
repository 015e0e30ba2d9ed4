"""Every ``SCALEDMM_*`` environment variable the package reads, in one place.

Each variable has one accessor here, with its meaning and default; the rest
of the package calls the accessor and never names the variable.  Accessors
read ``os.environ`` at call time (a test or tool may change a variable between
calls); a module that fixes a value at import says so where it calls.

``VARIABLES`` maps every fixed name to a one-line description (the README's
"Environment variables" table lists the same).  Two families of names are
built: ``SCALEDMM_<FAMILY>_BACKEND`` (:func:`backend_var`) and the policy
switches that the policy files name (:func:`is_switch_var`).

Examples
--------
>>> import os
>>> from scaledmm import env
>>> os.environ[env.SKINNY_KERNEL] = "tma"; env.skinny_kernel()
'tma'
>>> del os.environ[env.SKINNY_KERNEL]; env.skinny_kernel()
'reg'
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping

__all__ = [
    "VARIABLES", "backend_var", "is_switch_var", "raw", "text", "get", "switched_on", "switch_on", "cache_dir",
    "jit_no_build", "nvcc", "cutlass_include", "nvfp4_predecode_w",
    "nvfp4_triton_decode", "skinny_kernel", "pdl", "nvfp4_cublaslt",
]

_PREFIX = "SCALEDMM_"

CACHE_DIR = _PREFIX + "CACHE_DIR"
JIT_NO_BUILD = _PREFIX + "JIT_NO_BUILD"
NVCC = _PREFIX + "NVCC"
CUTLASS_INCLUDE = _PREFIX + "CUTLASS_INCLUDE"
NVFP4_PREDECODE_W = _PREFIX + "NVFP4_PREDECODE_W"
NVFP4_TRITON_DECODE = _PREFIX + "NVFP4_TRITON_DECODE"
SKINNY_KERNEL = _PREFIX + "SKINNY_KERNEL"
NVFP4_GEMV = _PREFIX + "NVFP4_GEMV"
NVFP4_MID = _PREFIX + "NVFP4_MID"
NVFP4_DECODE_CUBLAS = _PREFIX + "NVFP4_DECODE_CUBLAS"
NVFP4_CUBLASLT = _PREFIX + "NVFP4_CUBLASLT"
NVFP4_WGMMA = _PREFIX + "NVFP4_WGMMA"
FP8_GEMV = _PREFIX + "FP8_GEMV"
FP8_WGMMA = _PREFIX + "FP8_WGMMA"
PDL = _PREFIX + "PDL"

#: name -> "effect (default)".  Family backend variables are listed by
#: :func:`backend_var`'s family names in the README.
VARIABLES: dict[str, str] = {
    CACHE_DIR: "root of the JIT disk cache (default ~/.cache/scaledmm)",
    JIT_NO_BUILD: "1/true/yes: a JIT cache miss raises instead of compiling (default unset: build)",
    NVCC: "path of nvcc for the CUTLASS build (default PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)",
    CUTLASS_INCLUDE: "CUTLASS include folder (default the nvidia-cutlass wheel's headers)",
    NVFP4_PREDECODE_W: "1: the nvfp4 Triton GEMM's largest M bucket decodes the weight to 16 bit "
                       "and calls cuBLAS; read at import (default 0)",
    NVFP4_TRITON_DECODE: "forces the nvfp4 Triton decoder: triton, ptx or ptx_direct, CUDA only (default the config's)",
    SKINNY_KERNEL: "tma: the skinny op uses the TMA-ring kernel; read at import (default reg)",
    NVFP4_GEMV: "0 or empty: cuda_gemv leaves nvfp4 automatic selection (default on)",
    NVFP4_MID: "0 or empty: cuda_mid leaves nvfp4 automatic selection (default on)",
    NVFP4_DECODE_CUBLAS: "0 or empty: decode_cublas leaves nvfp4 automatic selection (default on)",
    NVFP4_CUBLASLT: "0, false, no or empty: decode_cublas multiplies with a cuBLAS fp32-output GEMM and a "
                    "Triton epilogue instead of one cuBLASLt call that reads alpha on the device and adds "
                    "the bias (default on)",
    NVFP4_WGMMA: "0 or empty: cuda_wgmma leaves nvfp4 automatic selection (default on)",
    FP8_GEMV: "0 or empty: cuda_gemv leaves fp8 and fp8_block automatic selection (default on)",
    FP8_WGMMA: "0 or empty: cuda_wgmma leaves fp8 automatic selection (default on)",
    PDL: "0 or empty: our kernels launch without programmatic dependent launch (default on, sm90 and newer)",
}

_SWITCH = re.compile(r"^SCALEDMM_[A-Z0-9_]+$")
_KEYS: dict[str, Any] = {}


def backend_var(family: str) -> str:
    """The variable that requests a backend for ``family`` (a backend name
    or ``auto``; default unset: automatic selection).

    Examples
    --------
    >>> backend_var("fp8_block")
    'SCALEDMM_FP8_BLOCK_BACKEND'
    """
    return f"{_PREFIX}{family.upper()}_BACKEND"


def is_switch_var(name: object) -> bool:
    """Whether ``name`` may name a policy switch (``SCALEDMM_`` + upper case).

    Examples
    --------
    >>> is_switch_var("SCALEDMM_NVFP4_GEMV"), is_switch_var("NVFP4_GEMV")
    (True, False)
    """
    return isinstance(name, str) and bool(_SWITCH.match(name))


def raw(var: str) -> Any:
    """``var``'s value (None when unset; on POSIX the undecoded bytes; pass it
    to :func:`text`), without ``os.environ.get``'s encode-and-KeyError cost
    (~0.5 us per unset variable): for the per-call selection path.

    Examples
    --------
    >>> text(raw("SCALEDMM_NO_SUCH_VARIABLE")) is None
    True
    """
    data = getattr(os.environ, "_data", None)
    if data is None:
        return os.environ.get(var)
    key = _KEYS.get(var)
    if key is None:
        key = _KEYS[var] = os.environ.encodekey(var)
    return data.get(key)


def text(value: Any) -> str | None:
    """A :func:`raw` value as ``str`` (None stays None).

    Examples
    --------
    >>> text(None), text("x")
    (None, 'x')
    """
    if value is None or isinstance(value, str):
        return value
    return os.environ.decodevalue(value)


def get(var: str) -> str | None:
    """``var``'s value now, None when unset (for reports and messages).

    Examples
    --------
    >>> get("SCALEDMM_NO_SUCH_VARIABLE") is None
    True
    """
    return os.environ.get(var)


def switched_on(value: str | None) -> bool:
    """A switch's meaning: off when ``"0"`` or empty, on when unset or any
    other value.

    Examples
    --------
    >>> switched_on(None), switched_on("1"), switched_on("0"), switched_on("")
    (True, True, False, False)
    """
    return value is None or value not in ("0", "")


def switch_on(var: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the policy switch ``var`` is on in ``environ`` (default
    ``os.environ``, read now).

    Examples
    --------
    >>> switch_on("SCALEDMM_NVFP4_GEMV", {"SCALEDMM_NVFP4_GEMV": "0"})
    False
    """
    return switched_on((os.environ if environ is None else environ).get(var))


def cache_dir() -> str | None:
    """``SCALEDMM_CACHE_DIR`` when set and non-empty, else None.

    Examples
    --------
    >>> import os; os.environ.pop(CACHE_DIR, None) and None; cache_dir() is None
    True
    """
    return os.environ.get(CACHE_DIR) or None


def jit_no_build() -> bool:
    """``SCALEDMM_JIT_NO_BUILD``: anything but unset, empty, 0, false or no
    (any case, spaces ignored) forbids JIT builds.

    Examples
    --------
    >>> import os; os.environ[JIT_NO_BUILD] = " False "; jit_no_build()
    False
    >>> os.environ[JIT_NO_BUILD] = "1"; jit_no_build()
    True
    >>> del os.environ[JIT_NO_BUILD]
    """
    return _flag(os.environ.get(JIT_NO_BUILD))


def nvcc() -> str | None:
    """``SCALEDMM_NVCC`` (the nvcc to use), None when unset.

    Examples
    --------
    >>> import os; os.environ.pop(NVCC, None) and None; nvcc() is None
    True
    """
    return os.environ.get(NVCC)


def cutlass_include() -> str | None:
    """``SCALEDMM_CUTLASS_INCLUDE`` (CUTLASS include folder), None when unset.

    Examples
    --------
    >>> import os; os.environ.pop(CUTLASS_INCLUDE, None) and None; cutlass_include() is None
    True
    """
    return os.environ.get(CUTLASS_INCLUDE)


def nvfp4_predecode_w() -> bool:
    """``SCALEDMM_NVFP4_PREDECODE_W``: exactly ``"1"`` turns it on.

    Examples
    --------
    >>> import os; os.environ.pop(NVFP4_PREDECODE_W, None) and None; nvfp4_predecode_w()
    False
    """
    return os.environ.get(NVFP4_PREDECODE_W) == "1"


def nvfp4_triton_decode(default: str) -> str:
    """``SCALEDMM_NVFP4_TRITON_DECODE`` when set (even empty), else ``default``.

    Examples
    --------
    >>> import os; os.environ.pop(NVFP4_TRITON_DECODE, None) and None; nvfp4_triton_decode("ptx")
    'ptx'
    """
    return os.environ.get(NVFP4_TRITON_DECODE, default)


def skinny_kernel() -> str:
    """``SCALEDMM_SKINNY_KERNEL``: ``"reg"`` (default) or ``"tma"``; any other
    value acts like ``"reg"``.

    Examples
    --------
    >>> import os; os.environ.pop(SKINNY_KERNEL, None) and None; skinny_kernel()
    'reg'
    """
    return os.environ.get(SKINNY_KERNEL, "reg")


def pdl() -> bool:
    """``SCALEDMM_PDL``: a switch (:func:`switched_on`), read at every launch.

    Examples
    --------
    >>> import os; os.environ[PDL] = "0"; pdl()
    False
    >>> del os.environ[PDL]; pdl()
    True
    """
    return switched_on(text(raw(PDL)))


def nvfp4_cublaslt() -> bool:
    """``SCALEDMM_NVFP4_CUBLASLT``: on when unset; empty, 0, false or no (any
    case, spaces ignored) turn it off; read at every call.  On by default:
    on the H200 the Llama-3-8B layer at M = 4096 took 2797 / 2732 us (W4A4 /
    W4A16) with it against 2988 / 3127 us without (benchmarks/RESULTS.md).

    Examples
    --------
    >>> import os; os.environ[NVFP4_CUBLASLT] = "0"; nvfp4_cublaslt()
    False
    >>> del os.environ[NVFP4_CUBLASLT]; nvfp4_cublaslt()
    True
    """
    value = text(raw(NVFP4_CUBLASLT))
    return value is None or _flag(value)


def _flag(value: str | None) -> bool:
    """An opt-in flag's meaning: on unless unset, empty, 0, false or no (any case, spaces ignored)."""
    return value is not None and value.strip().lower() not in ("", "0", "false", "no")
