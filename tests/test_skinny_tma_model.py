"""A CPU run of the data movement of ``csrc/dsv3_fused_a_gemm_tma.cu``.

The kernel needs an sm90 GPU.  Its index math is plain C++ in namespace
``fat`` of the .cu file: the CTA's work (tiles, chunks, the resident x range),
the shared-memory offsets of the producer's copies and of each consumer lane's
16-byte fragments, the warps' roles, where each accumulator lands in the tile
and the split-K inbox.  Here that code is compiled for the host with each
config's defines (``csrc_harness``; ``FA_SMEM_BYTES`` from the Python launcher,
which the kernel's static_assert checks) and this model moves the data through
it: weight and x bytes into a flat shared memory, fragments read back where
the lanes read them, multiplied as ``mma.sync m16n8k16`` defines its fragments
(the PTX ISA), sums placed where the kernel stores them.  The loops (tiles,
chunks, units, subtiles) follow the kernel's; the result must be the float64
product.  The GPU tests and ``benchmarks/experiments/skinny.py`` check the real thing.
"""

from __future__ import annotations

import numpy as np
import pytest

from csrc_harness import build, needs_nvcc
from scaledmm.ops import skinny_fused_a as fa

pytestmark = needs_nvcc


class Fat:
    """The kernel's index functions for one instantiation, as tables over
    their domains (one harness call each)."""

    def __init__(self, harness, gx: int):
        self.h = harness
        c = self.c = harness.consts()
        self.work = {}
        recs = [(bx, gx, r) for bx in range(gx) for r in range(c["SPLIT"])]
        for (bx, _, r), v in zip(recs, harness.ints("work", recs)):
            self.work[(bx, r)] = dict(zip(("tile0", "step", "ntile", "c_begin", "cpt", "total", "x_k0", "x_len"), v))
        recs = [(bx, gx, r, g) for (bx, r), wk in self.work.items() for g in range(wk["total"])]
        self.seq = {}
        for (bx, _, r, g), (t, ch) in zip(recs, harness.ints("sequence", recs)):
            self.seq[(bx, r, g)] = (t, ch)
        total = max(wk["total"] for wk in self.work.values())
        cpt = max(wk["cpt"] for wk in self.work.values())
        T = self.table
        self.tile_rows, self.chunk_len = T("tile_rows", c["TILES"]), T("chunk_len", c["CHUNKS"])
        self.stage_w = T("stage_w", total)
        self.lane_w, self.lane_x = T("lane_w", 8, 4), T("lane_x", 8, 4)
        self.read_w, self.read_x = T("read_w", c["STAGES"]), T("read_x", c["STAGES"], cpt)
        self.row_w, self.row_x, self.unit_off = T("row_w", c["NT"], 2), T("row_x", c["MF"]), T("unit_off", c["UNITS"])
        self.warp_tg, self.warp_kg = T("warp_tg", c["CW"]), T("warp_kg", c["CW"])
        self.subtile, self.unit_of = T("subtile", c["TG"], c["WT"]), T("unit_of", c["KW"], c["UPW"])
        self.acc_row, self.acc_mm = T("acc_row", c["NT"], 8), T("acc_mm", c["MF"], 4)
        self.elem = T("elem", c["MB"], c["ROWS"])
        self.elem_mm, self.elem_r = T("elem_mm", c["TILE"]), T("elem_r", c["TILE"])
        self.owner_of, self.inbox_index = T("owner_of", c["TILE"]), T("inbox_index", c["TILE"])
        self.inbox_base = T("inbox_base", c["SPLIT"])

    def table(self, op: str, *dims: int) -> np.ndarray:
        grid = np.meshgrid(*(np.arange(d) for d in dims), indexing="ij")
        recs = np.stack([g.ravel() for g in grid], 1)
        return self.h.ints(op, recs)[:, 0].reshape(dims)


def _mma(acc: np.ndarray, lo: np.ndarray, hi: np.ndarray, xf: np.ndarray, h: int) -> None:
    """acc[16, 8] += A @ B for one k16 step, from per-lane registers.

    lo, hi: [32 lanes, 8] weight elements of rows g and g + 8 (k = 8t .. 8t+7 of
    a unit); xf: [32, 8] x row g.  Register j of a lane holds elements 2j, 2j+1.
    Step h passes registers 2h (a0/a1, b0) and 2h + 1 (a2/a3, b1), as the
    kernel's mma_bf16 call does."""
    a = np.zeros((16, 16))
    b = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a[g, 2 * t:2 * t + 2] = lo[lane, 4 * h:4 * h + 2]  # a0: row g, cols 2t, 2t+1
        a[g + 8, 2 * t:2 * t + 2] = hi[lane, 4 * h:4 * h + 2]  # a1: row g+8
        a[g, 2 * t + 8:2 * t + 10] = lo[lane, 4 * h + 2:4 * h + 4]  # a2: row g, cols 2t+8, 2t+9
        a[g + 8, 2 * t + 8:2 * t + 10] = hi[lane, 4 * h + 2:4 * h + 4]  # a3
        b[2 * t:2 * t + 2, g] = xf[lane, 4 * h:4 * h + 2]  # b0: k 2t, 2t+1, col g
        b[2 * t + 8:2 * t + 10, g] = xf[lane, 4 * h + 2:4 * h + 4]  # b1
    acc += a @ b


def emulate(fat: Fat, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What the kernel writes into out [m, N] (NaN where it writes nothing)."""
    c = fat.c
    m, k = x.shape
    n = w.shape[0]
    assert (n, k) == (c["N"], c["K"])
    ROWS, SPLIT, CHUNK, STAGES, MB, MF = c["ROWS"], c["SPLIT"], c["CHUNK"], c["STAGES"], c["MB"], c["MF"]
    TILE, PER, KW, WT, PITCH = c["TILE"], c["PER"], c["KW"], c["WT"], c["PITCH"]
    XRES = bool(c["XRES"])
    mv = min(m, MB)
    out = np.full((m, n), np.nan)
    lanes = np.arange(32)
    g8s, t4s = lanes >> 2, lanes & 3
    inboxes = {key: np.full(SPLIT * PER, np.nan) for key in fat.work}  # each CTA's inbox (DSMEM)
    for (bx, rank), wk in fat.work.items():
        smem = np.full(c["SMEM"] // 2, np.nan)  # bf16 elements; offsets below are bytes

        def put(byte, vals):
            assert byte % 2 == 0 and byte + 2 * len(vals) <= c["RING_BYTES"] + c["XRES_BYTES"]
            smem[byte // 2:byte // 2 + len(vals)] = vals

        def frags(byte):  # the 16 bytes each lane reads at byte[lane]
            return np.stack([smem[b // 2:b // 2 + 8] for b in byte])

        if XRES:
            for r in range(mv):
                put(c["RING_BYTES"] + r * c["XPITCH"], x[r, wk["x_k0"]:wk["x_k0"] + wk["x_len"]])
        red = np.full(2 * KW * TILE, np.nan)
        g = 0
        for i in range(wk["ntile"]):
            tile = wk["tile0"] + i * wk["step"]
            rows = fat.tile_rows[tile]
            acc = {(wp, a, f): np.zeros((16, 8)) for wp in range(c["CW"]) for a in range(WT) for f in range(MF)}
            for j in range(wk["cpt"]):
                # producer: chunk g of the CTA's sequence into its stage
                t, ch = fat.seq[(bx, rank, g)]
                assert t == tile
                base = fat.stage_w[g]
                smem[base // 2:(base + c["STAGE_BYTES"]) // 2] = np.nan  # the slot's previous chunk is gone
                ln = fat.chunk_len[ch]
                for r in range(fat.tile_rows[t]):
                    put(base + r * PITCH, w[t * ROWS + r, ch * CHUNK:ch * CHUNK + ln])
                if not XRES:
                    for r in range(mv):
                        put(base + c["STAGE_W"] + r * PITCH, x[r, ch * CHUNK:ch * CHUNK + ln])
                # consumers
                s = g % STAGES
                units = c["UNITS"] if c["EVEN_UNITS"] else fat.chunk_len[wk["c_begin"] + j] // 32
                for wp in range(c["CW"]):
                    tg, kg = fat.warp_tg[wp], fat.warp_kg[wp]
                    for q in range(c["UPW"]):
                        u = fat.unit_of[kg, q]
                        if u >= units:
                            break
                        xb = fat.read_x[s, j] + fat.lane_x[g8s, t4s] + fat.unit_off[u]
                        xf = [frags(xb + fat.row_x[f]) for f in range(MF)]
                        for a in range(WT):
                            st = fat.subtile[tg, a]
                            if st * 16 >= rows:
                                continue
                            wb = fat.read_w[s] + fat.lane_w[g8s, t4s] + fat.unit_off[u]
                            lo, hi = frags(wb + fat.row_w[st, 0]), frags(wb + fat.row_w[st, 1])
                            for h in range(2):
                                for f in range(MF):
                                    _mma(acc[(wp, a, f)], lo, hi, xf[f], h)
                g += 1

            n_base = tile * ROWS

            def emit(e, v):
                mm, r = fat.elem_mm[e], fat.elem_r[e]
                if mm >= mv or r >= rows:
                    return
                if SPLIT == 1:
                    out[mm, n_base + r] = v
                else:
                    inboxes[(bx, fat.owner_of[e])][fat.inbox_base[rank] + fat.inbox_index[e]] = v

            buf = red[(i & 1) * KW * TILE:]
            for wp in range(c["CW"]):
                tg, kg = fat.warp_tg[wp], fat.warp_kg[wp]
                for a in range(WT):
                    st = fat.subtile[tg, a]
                    for f in range(MF):
                        d = acc[(wp, a, f)]
                        for g8, t4 in zip(g8s, t4s):
                            r, mm = fat.acc_row[st, g8], fat.acc_mm[f, t4]
                            # the D fragment: c0 (g, 2t), c1 (g, 2t+1), c2 (g+8, 2t), c3 (g+8, 2t+1)
                            vals = (d[g8, 2 * t4], d[g8, 2 * t4 + 1], d[g8 + 8, 2 * t4], d[g8 + 8, 2 * t4 + 1])
                            where = (fat.elem[mm, r], fat.elem[mm + 1, r], fat.elem[mm, r] + 8,
                                     fat.elem[mm + 1, r] + 8)
                            for e, v in zip(where, vals):
                                if KW == 1:
                                    emit(e, v)
                                else:
                                    buf[kg * TILE + e] = v
            if KW > 1:
                for e in range(TILE):
                    v = buf[e]
                    for q in range(1, KW):
                        v += buf[q * TILE + e]
                    emit(e, v)
    if SPLIT > 1:  # after the cluster barrier: each rank adds its PER elements over the ranks
        for (bx, rank), wk in fat.work.items():
            tile = wk["tile0"]
            rows = fat.tile_rows[tile]
            inbox = inboxes[(bx, rank)]
            for j in range(PER):
                e = fat.inbox_base[rank] + j
                if e >= TILE:
                    break
                v = inbox[j]
                for p in range(1, SPLIT):
                    v += inbox[fat.inbox_base[p] + j]
                mm, r = fat.elem_mm[e], fat.elem_r[e]
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
_ids = [f"{cfg.short()}-{n}x{k}-m{m}" for cfg, n, k, m, _ in CASES]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The host build of the .cu file for each case (built once)."""
    out = {}
    for cfg, n, k, m, _ in CASES:
        mb = fa.m_bucket(m)
        key = (cfg, n, k, mb)
        if key not in out:
            out[key] = build("skinny_tma_host.cu", tmp_path_factory.mktemp("tma"), cfg.defines(n, k, mb))
    return out


@pytest.mark.parametrize("cfg,n,k,m,sms", CASES, ids=_ids)
def test_model_matches_f64(kernels, cfg, n, k, m, sms):
    mb = fa.m_bucket(m)
    assert fa.config_valid(cfg, n, k, mb) == (True, "ok")
    fat = Fat(kernels[(cfg, n, k, mb)], cfg.grid(n, sms)[0])
    assert cfg.grid(n, sms)[1] == fat.c["SPLIT"]
    rng = np.random.default_rng(0)
    x, w = _bf16_values(rng, (m, k)), _bf16_values(rng, (n, k))
    out = emulate(fat, x, w)
    assert not np.isnan(out).any(), "some outputs never written"
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("cfg,n,k,m,sms", CASES, ids=_ids)
def test_layout_is_the_kernels(kernels, cfg, n, k, m, sms):
    """``TmaConfig.layout`` (what the launcher passes) against the .cu file's
    constexprs, and the bank-conflict-free pitches (64 mod 128 bytes)."""
    mb = fa.m_bucket(m)
    c = kernels[(cfg, n, k, mb)].consts()
    lay = cfg.layout(n, k, mb)
    assert (lay["pitch"], lay["stage_w"], lay["stage"], lay["ring"], lay["xres"], lay["red"], lay["inbox"],
            lay["kgroups"], lay["chunks"], lay["smem"]) == (
        c["PITCH"], c["STAGE_W"], c["STAGE_BYTES"], c["RING_BYTES"], c["XRES_BYTES"], c["RED_BYTES"],
        c["INBOX_BYTES"], c["KW"], c["CHUNKS"], c["SMEM"])
    assert c["PITCH"] % 128 == 64 and c["XPITCH"] % 128 == 64
