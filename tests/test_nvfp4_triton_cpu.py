"""CPU tests of the GPU-only pieces of the NVFP4 Triton backend: the inline-PTX
decoders on a small PTX emulator over every byte value and every e4m3 scale;
the config space."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from scaledmm.ops import nvfp4_triton as nt
from scaledmm.ops import nvfp4_triton_decode as nd
from nvfp4_triton_helpers import CHILD, parent, triton_problem

FP8 = torch.float8_e4m3fn
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


# ----------------------------------------------------------------------------
# CPU: the inline-PTX decoders on a PTX emulator, the config space
# ----------------------------------------------------------------------------


def _f16(bits):
    return np.asarray(bits, dtype=np.uint16).view(np.float16)


def _to_bf16_bits(v):
    return torch.from_numpy(np.asarray(v, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy() \
        .astype(np.uint32) & 0xFFFF


def _bf16_f64(bits):
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def _emulate(asm: str, regs: dict) -> dict:
    """Vectorized emulation (uint32 numpy arrays) of the PTX the decoders use."""
    env = dict(regs)

    def val(t):
        t = t.strip()
        return np.uint32(int(t, 16)) if t.startswith("0x") else env[t]

    for line in asm.split("\n"):
        line = line.strip().rstrip(";")
        if not line or line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if rest.startswith("{"):  # mov.b32 {h0, h1}, src
            lo_hi, src = rest.split("},")
            h0, h1 = (t.strip() for t in lo_hi.strip("{ ").split(","))
            env[h0], env[h1] = val(src) & 0xFFFF, val(src) >> 16
            continue
        a = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            env[a[0]] = val(a[1]) + np.zeros_like(env["$4"])
        elif op == "and.b32":
            env[a[0]] = val(a[1]) & val(a[2])
        elif op == "shl.b32":
            env[a[0]] = (val(a[1]) << np.uint32(int(a[2]))) & np.uint32(0xFFFFFFFF)
        elif op == "shr.b32":
            env[a[0]] = val(a[1]) >> np.uint32(int(a[2]))
        elif op == "prmt.b32":  # default mode: selector nibble i picks byte i
            x, y, sel = val(a[1]), val(a[2]), int(a[3], 16)
            pool = [(x >> np.uint32(8 * i)) & 0xFF for i in range(4)] + [(y >> np.uint32(8 * i)) & 0xFF for i in range(4)]
            out = np.zeros_like(x)
            for i in range(4):
                nib = (sel >> (4 * i)) & 0xF
                byte = pool[nib & 7]
                if nib & 8:
                    byte = np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0))
                out |= byte << np.uint32(8 * i)
            env[a[0]] = out
        elif op == "lop3.b32":
            x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), int(a[4], 16)
            out = np.zeros_like(x)
            for idx in range(8):
                if lut >> idx & 1:
                    fx = x if idx & 4 else ~x
                    fy = y if idx & 2 else ~y
                    fz = z if idx & 1 else ~z
                    out |= fx & fy & fz
            env[a[0]] = out
        elif op == "mul.rn.f16x2":  # fp16 x fp16 is exact in fp32, one rounding to fp16
            x, y = val(a[1]), val(a[2])
            lo = (_f16(x & 0xFFFF).astype(np.float32) * _f16(y & 0xFFFF).astype(np.float32)).astype(np.float16)
            hi = (_f16(x >> 16).astype(np.float32) * _f16(y >> 16).astype(np.float32)).astype(np.float16)
            env[a[0]] = lo.view(np.uint16).astype(np.uint32) | (hi.view(np.uint16).astype(np.uint32) << 16)
        elif op == "fma.rn.bf16x2":  # exact in float64, one rounding to bf16
            x, y, z = val(a[1]), val(a[2]), val(a[3])
            halves = [_bf16_f64((x >> s) & 0xFFFF) * _bf16_f64((y >> s) & 0xFFFF) + _bf16_f64((z >> s) & 0xFFFF)
                      for s in (np.uint32(0), np.uint32(16))]
            env[a[0]] = _to_bf16_bits(halves[0]) | (_to_bf16_bits(halves[1]) << 16)
        elif op == "cvt.f32.f16":
            env[a[0]] = _f16(val(a[1])).astype(np.float32)
        elif op == "cvt.rn.bf16x2.f32":
            env[a[0]] = _to_bf16_bits(env[a[2]]) | (_to_bf16_bits(env[a[1]]) << 16)
        else:
            raise AssertionError(f"emulator lacks {op}")
    return env


@parent
@pytest.mark.parametrize("kind", ["f16", "bf16", "bf16_direct"])
def test_ptx_decoders_on_emulator(kind):
    """Every byte value with every finite e4m3 scale: the PTX gives the fp16 /
    bf16 pair [hi * s : lo * s] * 2**-fold of byte j, bit for bit (signs too)."""
    asm = {"f16": nd.PTX_F16, "bf16": nd.PTX_BF16, "bf16_direct": nd.PTX_BF16_DIRECT}[kind].value
    scales = torch.arange(0, 127, dtype=torch.int32).to(torch.uint8).view(FP8).double()  # 0 .. 448
    byte = np.repeat(np.arange(256, dtype=np.uint32), len(scales))
    sc = np.tile(scales.numpy(), 256)
    rng = np.random.default_rng(0)
    other = rng.integers(0, 256, (3, byte.size), dtype=np.uint32)
    regs = {}
    for j in range(4):  # put the byte under test at every position j
        pos = [other[(j + i) % 3] for i in range(3)]
        bytes4 = pos[:j] + [byte] + pos[j:]
        regs[j] = bytes4[0] | (bytes4[1] << 8) | (bytes4[2] << 16) | (bytes4[3] << 24)
    if kind == "bf16_direct":
        s_bits = _to_bf16_bits(sc * 2.0 ** 119)
        fold = 2.0 ** 7
    else:
        s_bits = np.asarray(sc, np.float16).view(np.uint16).astype(np.uint32)
        fold = 2.0 ** 14
    s_pair = s_bits | (s_bits << 16)
    codes = torch.from_numpy(byte.astype(np.int64))
    lo_c, hi_c = codes & 15, codes >> 4
    val = lambda c: (E2M1[c & 7] * torch.where(c >= 8, -1.0, 1.0).double()).numpy()  # noqa: E731
    want_lo, want_hi = val(lo_c) * sc, val(hi_c) * sc
    for j in range(4):
        env = _emulate(asm, {"$4": regs[j], "$5": s_pair, "$6": s_pair, "$7": s_pair, "$8": s_pair})
        out = env[f"${j}"]
        if kind == "f16":
            lo, hi = _f16(out & 0xFFFF).astype(np.float64), _f16(out >> 16).astype(np.float64)
        else:
            lo, hi = _bf16_f64(out & 0xFFFF), _bf16_f64(out >> 16)
        np.testing.assert_array_equal(lo * fold, want_lo)
        np.testing.assert_array_equal(hi * fold, want_hi)
        np.testing.assert_array_equal(np.signbit(lo), np.signbit(want_lo))
        np.testing.assert_array_equal(np.signbit(hi), np.signbit(want_hi))


def test_config_predicate():
    p = triton_problem(16)
    assert nt.config_ok(nt.GemmConfig(64, 16, 256, decode="triton"), p)[0]
    bad = [nt.GemmConfig(48, 16, 256, decode="triton"),           # not a power of two
           nt.GemmConfig(64, 8, 256, decode="triton"),            # block_m < 16
           nt.GemmConfig(64, 16, 32, decode="triton"),            # block_k < 64
           nt.GemmConfig(64, 16, 256, split_k=17, decode="triton"),
           nt.GemmConfig(64, 16, 256),                            # PTX decoder on the CPU
           nt.GemmConfig(64, 16, 256, decode="nope")]
    for cfg in bad:
        assert not nt.config_ok(cfg, p)[0], cfg
    assert not nt.config_ok(nt.GemmConfig(64, 16, 256, decode="triton", predecode_x=True),
                            triton_problem(16, w4a16=True))[0]
    big = nt.GemmConfig(256, 256, 512, num_stages=8)
    assert not nt.config_ok(big, triton_problem(4096, device="cuda"), torch.device("cuda"))[0]  # shared memory


def test_default_and_candidate_configs_are_valid():
    for m in (1, 16, 17, 64, 65, 256, 257, 4096):
        for w4a16 in (False, True):
            p = triton_problem(m, w4a16=w4a16)
            cfg = nt.default_config(p)
            assert nt.config_ok(cfg, p)[0] and cfg.decode == "triton"
            assert all(nt.config_ok(c, p)[0] for c in nt.candidate_configs(p))
    for m, b in ((1, 0), (16, 0), (17, 1), (64, 1), (65, 2), (256, 2), (257, 3)):
        assert nt.m_bucket(m) == b
    for b, cfg in nt.DEFAULT_CONFIGS.items():
        assert cfg.split_k == nt.AUTO_SPLIT  # bucket defaults: split-K by rule
        for w4a16 in (False, True):
            p = triton_problem(16, w4a16=w4a16, device="cuda")
            ok, why = nt.config_ok(dataclasses.replace(cfg, split_k=1), p, torch.device("cuda"))
            assert ok, (b, why)


def test_tuned_row_is_used_as_measured(monkeypatch):
    """A per-shape row's split_k and predecode_x are the kernel's; only the
    bucket defaults (split_k 0) get the rule's."""
    from scaledmm import kernel_tuning

    p = triton_problem(40)  # bucket 1: the rule halves the split and may predecode
    ruled = nt.default_config(p)
    table = kernel_tuning.load("nvfp4_triton", "sm90", nt.GemmConfig)
    row = dataclasses.replace(table.default[1][1], split_k=1, predecode_x=not ruled.predecode_x)
    monkeypatch.setattr(type(table), "lookup", lambda self, n, k, m: row)
    got = nt.default_config(p)
    assert (got.split_k, got.predecode_x) == (1, row.predecode_x) != (ruled.split_k, ruled.predecode_x)


@parent
def test_not_supported_on_cpu_without_interpreter():
    if nt.interpreting():
        pytest.skip("TRITON_INTERPRET is set in this process")
    ok, why = nt.is_supported(torch.device("cpu"))
    assert not ok and "TRITON_INTERPRET" in why
