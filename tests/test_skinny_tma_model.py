"""A CPU model of the index math of ``csrc/dsv3_fused_a_gemm_tma.cu``.

The kernel needs an sm90 GPU; this model replays, in NumPy, what its producer
copies where (``TmaConfig.layout``: pitches, stage offsets, resident x), which
16-byte fragments each consumer lane reads, how ``mma.sync m16n8k16`` combines
them (the PTX fragment layouts), and the k-group, split-K and persistent-tile
bookkeeping, then checks the result against a float64 product.  It mirrors the
kernel line by line (same names), so an edit of one must be repeated in the
other; the GPU tests and ``benchmarks/device_skinny.py`` check the real thing.
"""

from __future__ import annotations

import numpy as np
import pytest

from scaledmm.ops import skinny_fused_a as fa


def _mma(acc: np.ndarray, lo: np.ndarray, hi: np.ndarray, xf: np.ndarray, h: int) -> None:
    """acc[16, 8] += A @ B for one k16 step, from per-lane registers.

    lo, hi: [32 lanes, 8] weight elements of rows g and g + 8 (k = 8t .. 8t+7 of
    a unit); xf: [32, 8] x row g.  Register j of a lane holds elements 2j, 2j+1.
    Step h uses registers 2h (a0/a1, b0) and 2h + 1 (a2/a3, b1)."""
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        r0 = lo[lane, 4 * h:4 * h + 2]  # register 2h of row g
        r1 = hi[lane, 4 * h:4 * h + 2]
        r2 = lo[lane, 4 * h + 2:4 * h + 4]  # register 2h + 1
        r3 = hi[lane, 4 * h + 2:4 * h + 4]
        a[g, 2 * t:2 * t + 2] = r0  # a0: row g, cols 2t, 2t+1
        a[g + 8, 2 * t:2 * t + 2] = r1  # a1: row g+8
        a[g, 2 * t + 8:2 * t + 10] = r2  # a2: row g, cols 2t+8, 2t+9
        a[g + 8, 2 * t + 8:2 * t + 10] = r3  # a3
        b[2 * t:2 * t + 2, g] = xf[lane, 4 * h:4 * h + 2]  # b0: k 2t, 2t+1, col g
        b[2 * t + 8:2 * t + 10, g] = xf[lane, 4 * h + 2:4 * h + 4]  # b1
    acc += a @ b


def emulate(cfg: fa.TmaConfig, x: np.ndarray, w: np.ndarray, mb: int, num_sms: int) -> np.ndarray:
    """What the kernel writes into out [m, N] (NaN where it writes nothing)."""
    m, k_ = x.shape
    n_, k = w.shape
    assert k_ == k
    lay = cfg.layout(n_, k, mb)
    ROWS, SPLIT, CHUNK, STAGES, CW, MB = cfg.rows, cfg.split_k, cfg.chunk, cfg.stages, cfg.warps, mb
    NT = ROWS // 16
    TG = min(CW, NT)
    WT, KW = NT // TG, CW // TG
    TILES = -(-n_ // ROWS)
    CHUNKS = -(-k // CHUNK)
    UNITS = CHUNK // 32
    UPW = -(-UNITS // KW)
    PITCH, XPITCH = lay["pitch"] // 2, (lay["xres"] // MB // 2 if cfg.x_resident else 0)  # in elements
    XRES = cfg.x_resident
    TILE = ROWS * MB
    PER = -(-TILE // SPLIT)
    mv = min(m, MB)
    out = np.full((m, n_), np.nan)
    gx, gy = cfg.grid(n_, num_sms)
    assert gy == SPLIT

    def tile_rows(tile):
        return min(ROWS, n_ - tile * ROWS)

    def chunk_len(c):
        return min(CHUNK, k - c * CHUNK)

    inboxes = {(bx, r): np.full(SPLIT * PER, np.nan) for bx in range(gx) for r in range(SPLIT)}  # DSMEM
    for bx in range(gx):
        for rank in range(SPLIT):
            tile0, step = bx, gx
            ntile = (TILES - tile0 + step - 1) // step
            c_begin = rank * CHUNKS // SPLIT
            cpt = (rank + 1) * CHUNKS // SPLIT - c_begin
            x_k0 = c_begin * CHUNK
            x_len = min((c_begin + cpt) * CHUNK, k) - x_k0
            ring = np.full((STAGES, ROWS + (0 if XRES else MB), PITCH), np.nan)
            xres = np.full((MB, XPITCH), np.nan) if XRES else None
            if XRES:
                for r in range(mv):
                    xres[r, :x_len] = x[r, x_k0:x_k0 + x_len]
            red = np.full((2, KW, TILE), np.nan)
            g = 0
            for i in range(ntile):
                tile = tile0 + i * step
                rows = tile_rows(tile)
                acc = {(wp, a, f): np.zeros((16, 8)) for wp in range(CW) for a in range(WT) for f in range(MB // 8)}
                for j in range(cpt):
                    # producer: chunk g into slot g % STAGES
                    s = g % STAGES
                    c = c_begin + j
                    ln = chunk_len(c)
                    ring[s] = np.nan
                    for r in range(rows):
                        ring[s, r, :ln] = w[tile * ROWS + r, c * CHUNK:c * CHUNK + ln]
                    if not XRES:
                        for r in range(mv):
                            ring[s, ROWS + r, :ln] = x[r, c * CHUNK:c * CHUNK + ln]
                    # consumers
                    units = ln // 32
                    for wp in range(CW):
                        tg, kg = wp % TG, wp // TG
                        for q in range(UPW):
                            u = kg + q * KW
                            if u >= units:
                                break
                            lanes = np.arange(32)
                            g8, t4 = lanes >> 2, lanes & 3
                            xf = []
                            for f in range(MB // 8):
                                if XRES:
                                    base = j * CHUNK + u * 32 + t4 * 8
                                    xf.append(np.stack([xres[f * 8 + g8[ln_], base[ln_]:base[ln_] + 8]
                                                        for ln_ in lanes]))
                                else:
                                    base = u * 32 + t4 * 8
                                    xf.append(np.stack([ring[s, ROWS + f * 8 + g8[ln_], base[ln_]:base[ln_] + 8]
                                                        for ln_ in lanes]))
                            for a in range(WT):
                                st = tg * WT + a
                                if st * 16 >= rows:
                                    continue
                                base = u * 32 + t4 * 8
                                lo = np.stack([ring[s, st * 16 + g8[l_], base[l_]:base[l_] + 8] for l_ in lanes])
                                hi = np.stack([ring[s, st * 16 + 8 + g8[l_], base[l_]:base[l_] + 8] for l_ in lanes])
                                for h in range(2):
                                    for f in range(MB // 8):
                                        _mma(acc[(wp, a, f)], lo, hi, xf[f], h)
                    g += 1
                # epilogue: D[row, col] of (wp, a, f) = weight row st*16+row, x row f*8+col
                n_base = tile * ROWS

                def emit(e, v):
                    mm, r = e // ROWS, e % ROWS
                    if mm >= mv or r >= rows:
                        return
                    if SPLIT == 1:
                        out[mm, n_base + r] = v
                    else:
                        owner = e // PER
                        inboxes[(bx, owner)][rank * PER + (e - owner * PER)] = v

                buf = red[i & 1]
                for wp in range(CW):
                    tg, kg = wp % TG, wp // TG
                    for a in range(WT):
                        st = tg * WT + a
                        for f in range(MB // 8):
                            d = acc[(wp, a, f)]
                            for row in range(16):
                                for col in range(8):
                                    e = (f * 8 + col) * ROWS + st * 16 + row
                                    if KW == 1:
                                        emit(e, d[row, col])
                                    else:
                                        buf[kg, e] = d[row, col]
                if KW > 1:
                    for e in range(TILE):
                        v = buf[0, e]
                        for q in range(1, KW):
                            v += buf[q, e]
                        emit(e, v)
    if SPLIT > 1:  # after the cluster barrier: each rank adds its PER elements over the ranks
        for bx in range(gx):
            tile = bx
            rows = tile_rows(tile)
            for rank in range(SPLIT):
                inbox = inboxes[(bx, rank)]
                for j in range(PER):
                    e = rank * PER + j
                    if e >= TILE:
                        break
                    v = inbox[j]
                    for p in range(1, SPLIT):
                        v += inbox[p * PER + j]
                    mm, r = e // ROWS, e % ROWS
                    if mm < mv and r < rows:
                        out[mm, tile * ROWS + r] = v
    return out


def _bf16_values(rng, shape):
    """float64 arrays of bf16-representable values."""
    v = rng.standard_normal(shape).astype(np.float32)
    bits = v.view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32).astype(np.float64)


CASES = [
    # (cfg, N, K, m, num_sms): partial tiles, partial chunks, uneven split ranks,
    # k-groups, several subtiles per warp, resident x, persistent loops
    (fa.TmaConfig(32, 2, 256, 3, 4), 96, 1024, 5, 132),
    (fa.TmaConfig(48, 4, 128, 2, 3), 80, 640, 16, 132),  # partial 48-row tile, 5 chunks over 4 ranks
    (fa.TmaConfig(64, 1, 256, 2, 2), 144, 640, 11, 2),  # persistent, 2 subtiles per warp, partial chunk
    (fa.TmaConfig(16, 1, 384, 2, 4, True), 64, 768, 9, 3),  # resident x, k-groups, 2 tiles per CTA
    (fa.TmaConfig(32, 3, 128, 4, 8, True), 32, 1152, 3, 132),  # resident x with split, 4 k-groups x 2
    (fa.TmaConfig(48, 1, 128, 3, 6), 96, 384, 1, 1),  # one CTA, 6 warps = 3 subtiles x 2 k-groups
    (fa.TmaConfig(16, 4, 192, 2, 4), 32, 768, 8, 132),  # 6 units over 4 k-groups (2, 2, 1, 1)
    (fa.TmaConfig(64, 3, 128, 2, 4), 80, 640, 10, 132),  # split-K pushed straight from registers, partial tile
]


@pytest.mark.parametrize("cfg,n,k,m,sms", CASES, ids=lambda v: v.short() if isinstance(v, fa.TmaConfig) else str(v))
def test_model_matches_f64(cfg, n, k, m, sms):
    mb = fa.m_bucket(m)
    assert fa.config_valid(cfg, n, k, mb) == (True, "ok")
    rng = np.random.default_rng(0)
    x, w = _bf16_values(rng, (m, k)), _bf16_values(rng, (n, k))
    out = emulate(cfg, x, w, mb, sms)
    assert not np.isnan(out).any(), "some outputs never written"
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-9, atol=1e-9)


def test_layout_matches_kernel_formula():
    """``layout`` is the .cu file's constexpr arithmetic (the kernel also
    static_asserts its total against FA_SMEM_BYTES when compiled)."""
    cfg = fa.TmaConfig(32, 2, 256, 3, 4)
    lay = cfg.layout(2112, 7168, 16)
    pitch = 256 * 2 + 64
    assert lay["pitch"] == pitch and pitch % 128 == 64
    assert lay["ring"] == 3 * (32 + 16) * pitch
    assert lay["red"] == 2 * 2 * 32 * 16 * 4  # two k-groups, double-buffered
    assert lay["inbox"] == 2 * (32 * 16 // 2) * 4  # two ranks' halves of the tile
    assert lay["smem"] == lay["ring"] + lay["red"] + lay["inbox"] + (2 * 3 + 1) * 8
