"""Every NVFP4 quantizer config of ``ops/nvfp4_triton_quant.py`` (each kernel
variant, the ``split8`` kernel at several tiles) bit-exact to the CPU
reference, on the CPU under the Triton interpreter.

The swizzled scale layout places row ``r`` by three terms (``r // 128``,
``r % 32``, ``(r % 128) // 32``); M = 33, 130 and 257 give rows past 32 and
128 in one and in several programs, so a wrong term moves scales.  The
swizzled scales are also read back with SPEC's offset formula written here
(not the reference's permute) and compared to the unswizzled reference.

``TRITON_INTERPRET`` must be set before Triton is first imported, so the
interpreter tests run in a child pytest (:func:`test_interpreter_suite`).
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import poison_, run_under_interpreter
from scaledmm.ops import nvfp4 as nv
from scaledmm.ops import nvfp4_triton_quant as ntq

CHILD = os.environ.get("SCALEDMM_NVFP4_QCFG_CHILD") == "1"
interp = pytest.mark.skipif(not CHILD, reason="runs in the interpreter subprocess (test_interpreter_suite)")
parent = pytest.mark.skipif(CHILD, reason="main-process test")

Q = ntq.QuantConfig
# the candidates (each variant) and split8 tiles of 8 to 128 rows per program
CONFIGS = list(dict.fromkeys(ntq.QUANT_CANDIDATES + (Q(8, 8, 1), Q(64, 4, 2), Q(128, 4, 4))))
assert {c.variant for c in CONFIGS} == set(ntq.VARIANTS)
SPLIT8 = [c for c in CONFIGS if c.variant == "split8"]


@parent
def test_interpreter_suite():
    run_under_interpreter(__file__, {"SCALEDMM_NVFP4_QCFG_CHILD": "1"})


@parent
def test_configs_are_valid_and_split8_is_covered():
    assert all(ntq.quant_config_ok(c)[0] for c in CONFIGS)
    assert len(SPLIT8) >= 3 and {c.block_m for c in SPLIT8} >= {8, 32, 128}


def spec_offsets(rows: int, cols: int) -> torch.Tensor:
    """SPEC's flat offset of scale ``[r, c]`` in the swizzled layout, ``[rows, cols]``."""
    cp = -(-cols // 4) * 4
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    return ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _quant(x, gs, swz, cfg, monkeypatch):
    real = nv.quant_outputs

    def poisoned(*args):  # the kernel must write every byte, the layout's pads included
        q, s = real(*args)
        return poison_(q), poison_(s)

    monkeypatch.setattr(nv, "quant_outputs", poisoned)
    return ntq.quant(x, gs, swz, cfg)


# split8 at every M; the rows kernels (covered by test_nvfp4_triton.py too) at one
CASES = [(c, m) for c in CONFIGS for m in ((1, 33, 130, 257) if c.variant == "split8" else (130,))]


@interp
@pytest.mark.parametrize("cfg, m", CASES, ids=lambda v: v.label() if isinstance(v, Q) else str(v))
def test_config_bit_exact_to_reference(monkeypatch, cfg, m, _seed):
    k = 80  # 5 blocks: a partial group tile, scale columns padded 5 -> 8
    # per-block magnitudes spread over 2**-6 .. 2**6: the scales differ from block to block
    x = torch.randn(m, k) * torch.exp2(torch.randint(-6, 7, (m, k // 16)).float()).repeat_interleave(16, 1)
    x = x.to(torch.bfloat16)
    gs = torch.tensor(448.0 * 6.0 / 64.0)
    q_lin, s_lin = nv.reference_quant(x, gs, swizzle=False)
    for swz in (True, False):
        q, s = _quant(x, gs, swz, cfg, monkeypatch)
        q_ref, s_ref = nv.reference_quant(x, gs, swizzle=swz)
        assert q.shape == q_ref.shape and s.shape == s_ref.shape, (cfg.label(), swz)
        bad_q = (_bytes(q) != _bytes(q_ref)).nonzero()
        assert not len(bad_q), (cfg.label(), swz, f"seed {_seed}", bad_q[:8].tolist())
        bad_s = (_bytes(s) != _bytes(s_ref)).nonzero()
        assert not len(bad_s), (cfg.label(), swz, f"seed {_seed}", bad_s[:8].tolist())
        if swz:
            off = spec_offsets(m, k // 16)
            flat = _bytes(s).flatten()
            torch.testing.assert_close(flat[off], _bytes(s_lin), rtol=0, atol=0)
            pads = torch.ones(flat.numel(), dtype=torch.bool)
            pads[off.flatten()] = False
            assert not flat[pads].any(), cfg.label()  # pad rows and columns are zero
    if m > 1:
        assert len(torch.unique(_bytes(s_lin))) >= 8  # scales that tell rows apart
