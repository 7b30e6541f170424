#!/usr/bin/env python3
# CPU check of the sm_90a wgmma BACKWARD's layout math (csrc/softmax/cuda/sm90/bwd_kernel.cuh), no GPU needed.
#
# Part 1 (addresses): for every shared-memory descriptor the kernel builds -- S^T = K Q^T and
# dP^T = V dO^T (A, B K-major), dV += P^T dO and dK += dS^T Q (B N-major), dQ = dS K (A M-major
# from the dS^T tile, B = K N-major) -- at D = 64 and 128, both consumer warpgroups, every k-step,
# ring slot, sub-block and dS^T buffer, the byte address wgmma reads for operand element (mn, k)
# (PTX ISA 9.7.15.5.1.2.1.3 canonical layouts: K-major SW128 ((8,m),(T,2k)):((8T,SBO),(1,T)),
# MN-major SW128 ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)), Swizzle<3,4,3> on byte address bits
# [4:6] ^= [7:9]; the same forms as CUTLASS make_gmma_desc) is compared with the address where
# the kernel put that element (wg::Sw128Tile::offset via produce_tile, or the dS^T st.shared).
# The descriptors are decoded from the 64-bit values built as the kernel builds them
# (make_desc_sw128 plus the >> 4 offsets it adds), so field packing and offset arithmetic are
# checked too.
#
# Part 2 (values): one query block of one CTA emulated end to end on random data with ragged
# ends (rows past the sequence end and columns past d zero-filled by the producer): produce_tile
# and the LSE / dot cp.async into a ring slot, the five wgmma products read through the
# descriptors (or RS A fragments packed as pack_a_frags does), the accumulator fragments
# (CUTLASS CLayout_64xN / ALayout_64x16), the kernel's per-thread (key, query) indexing of LSE
# and dot, P^T and dS^T (scale once), the dS^T st.shared, add_dq's c / c^1 shuffle and float4
# destinations, and the dK / dV epilogue -- against numpy references of dkdv_kernel's math.
import itertools

import numpy as np


def sw128(addr):  # Swizzle<3,4,3> on byte addresses
    return addr ^ (((addr >> 7) & 7) << 4)


class Tile:  # wg::Sw128Tile<kRows, kCols>
    def __init__(self, rows, cols):
        self.rows, self.cols = rows, cols
        self.chunks = cols // 8
        self.block_bytes = rows * 128
        self.bytes = rows * cols * 2

    def offset(self, r, col):
        c = col >> 3
        return (c >> 3) * self.block_bytes + r * 128 + (((c & 7) ^ (r & 7)) << 4) + (col & 7) * 2


def make_desc(addr, lbo, sbo):  # wg::make_desc_sw128
    return (((addr & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16) | (((sbo >> 4) & 0x3FFF) << 32)
            | (1 << 62))


def decode(desc):
    assert desc >> 62 == 1 and (desc >> 49) & 7 == 0, "128B swizzle, base offset 0"
    return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4


def addr_kmajor(desc, mn, k):  # element (mn, k) of a K-major operand, k < 16
    start, _, sbo = decode(desc)
    return sw128(start + (mn % 8) * 128 + (mn // 8) * sbo + (k // 8) * 16 + (k % 8) * 2)


def addr_mnmajor(desc, mn, k):  # element (mn, k) of an MN-major operand, k < 16
    start, lbo, sbo = decode(desc)
    return sw128(start + ((mn % 64) // 8) * 16 + (mn % 8) * 2 + (mn // 64) * lbo + (k % 8) * 128
                 + (k // 8) * sbo)


def clayout(t, v):  # CLayout_64xN / ALayout_64x16: thread t, value v -> (row m, col n)
    c, g, w = t % 4, (t // 4) % 8, t // 32
    idx = c * 128 + g + w * 16 + (v % 2) * 64 + ((v // 2) % 2) * 8 + (v // 4) * 512
    return idx % 64, idx // 64


def kmajor_step(tile, kk):  # sm90/fwd_kernel.cuh kmajor_step, already >> 4
    return ((kk >> 2) * tile.block_bytes + (kk & 3) * 32) >> 4


class Plan:  # BwdPlan<kD>
    def __init__(self, D):
        self.D = D
        self.kBlockM = 128 if D == 64 else 64
        self.kStages, self.kBlockN, self.kSub = 2, 128, self.kBlockM // 64
        self.kDqRowBlocks = self.kBlockM // 64
        self.TileKV, self.TileQ = Tile(128, D), Tile(self.kBlockM, D)
        self.TileS = Tile(128, self.kBlockM)
        self.kK = 0
        self.kV = self.kK + self.TileKV.bytes
        self.kQ = self.kV + self.TileKV.bytes
        self.kdO = self.kQ + self.kStages * self.TileQ.bytes
        self.kdS = self.kdO + self.kStages * self.TileQ.bytes
        self.kLse = self.kdS + 2 * self.TileS.bytes
        self.kDot = self.kLse + self.kStages * self.kBlockM * 4
        self.kBar = self.kDot + self.kStages * self.kBlockM * 4


BASE = 1024 * 5  # the kernel's 1024-aligned base: any such value


def descriptors(P, cw, swap_ds=False):  # consume_bwd's descriptors, verbatim
    d = {}
    d["k"] = make_desc(BASE + P.kK + cw * 64 * 128, 16, 1024)
    d["v"] = make_desc(BASE + P.kV + cw * 64 * 128, 16, 1024)
    d["q"] = make_desc(BASE + P.kQ, 16, 1024)
    d["do"] = make_desc(BASE + P.kdO, 16, 1024)
    d["q_n"] = make_desc(BASE + P.kQ, P.TileQ.block_bytes, 1024)
    d["do_n"] = make_desc(BASE + P.kdO, P.TileQ.block_bytes, 1024)
    d["dq_row"] = (cw % P.kDqRowBlocks) * 64
    d["dq_col"] = (cw // P.kDqRowBlocks) * 64
    d["ds"] = make_desc(BASE + P.kdS + (d["dq_row"] // 64) * P.TileS.block_bytes,
                        *((1024, P.TileS.block_bytes) if swap_ds else (P.TileS.block_bytes, 1024)))
    d["k_n"] = make_desc(BASE + P.kK + (d["dq_col"] // 64) * P.TileKV.block_bytes, P.TileKV.block_bytes, 1024)
    return d


# ------------------------------------------------------------------ part 1: addresses
def part1(swap_ds=False):
    bad = checked = 0
    for D in (64, 128):
        P = Plan(D)
        for cw in (0, 1):
            d = descriptors(P, cw, swap_ds)
            for stage, sb in itertools.product(range(P.kStages), range(P.kSub)):
                slot = (stage * P.TileQ.bytes) >> 4
                sub = slot + ((sb * 64 * 128) >> 4)
                # S^T = K Q^T, dP^T = V dO^T: A = 64 keys of K / V, B = 64 queries of the slot
                for kk in range(D // 16):
                    for name_a, off_a, name_b, off_b in (("k", P.kK, "q", P.kQ), ("v", P.kV, "do", P.kdO)):
                        da = d[name_a] + kmajor_step(P.TileKV, kk)
                        db = d[name_b] + sub + kmajor_step(P.TileQ, kk)
                        for mn in range(64):
                            for k in range(16):
                                checked += 2
                                bad += addr_kmajor(da, mn, k) != BASE + off_a + P.TileKV.offset(64 * cw + mn, 16 * kk + k)
                                bad += addr_kmajor(db, mn, k) != (BASE + off_b + stage * P.TileQ.bytes
                                                                   + P.TileQ.offset(64 * sb + mn, 16 * kk + k))
                # dV += P^T dO, dK += dS^T Q: B = (K = 16 queries, N = D) N-major
                for kk in range(4):
                    for name_b, off_b in (("do_n", P.kdO), ("q_n", P.kQ)):
                        db = d[name_b] + sub + ((kk * 16 * 128) >> 4)
                        for n in range(D):
                            for k in range(16):
                                checked += 1
                                bad += addr_mnmajor(db, n, k) != (BASE + off_b + stage * P.TileQ.bytes
                                                                   + P.TileQ.offset(64 * sb + 16 * kk + k, n))
            # dQ = dS K: A = dS (M = 64 queries, K = keys) from dS^T M-major, B = K N-major
            for it, kk in itertools.product(range(2), range(P.kBlockN // 16)):
                da = d["ds"] + (((it & 1) * P.TileS.bytes + kk * 2048) >> 4)
                db = d["k_n"] + ((kk * 2048) >> 4)
                for mn in range(64):
                    for k in range(16):
                        checked += 2
                        # the kernel stores dS^T (key, query) at s_ds + TileS::offset(key, query)
                        bad += addr_mnmajor(da, mn, k) != (BASE + P.kdS + (it & 1) * P.TileS.bytes
                                                            + P.TileS.offset(16 * kk + k, d["dq_row"] + mn))
                        bad += addr_mnmajor(db, mn, k) != BASE + P.kK + P.TileKV.offset(16 * kk + k, d["dq_col"] + mn)
    return bad, checked


# ------------------------------------------------------------------ part 2: values
def part2(D, stage, it, rows_k, rows_q, d_valid, seed):
    P = Plan(D)
    rng = np.random.default_rng(seed)
    nbytes = BASE + P.kBar
    mem = np.full(nbytes // 2, np.nan)  # 16-bit elements by byte address / 2; NaN = never written
    fmem = {}  # the fp32 LSE / dot rings by byte address
    scale = 1.0 / np.sqrt(d_valid)
    log2e = 1.4426950408889634

    def produce_tile(smem, gmem, rows, valid_rows, valid_cols):  # produce_tile, per thread
        tile = Tile(rows, D)
        chunks = tile.chunks
        step = 128 // chunks
        for ptid in range(128):
            c = ptid % chunks
            col_ok = c * 8 < valid_cols
            r = ptid // chunks
            dst = smem + tile.offset(r, c * 8)
            while r < rows:
                ok = col_ok and r < valid_rows
                for e in range(8):
                    mem[(dst + 2 * e) // 2] = gmem[r, c * 8 + e] if ok else 0.0
                r += step
                dst += step * 128

    def padded(rows, valid_rows):  # random (rows, D) with rows / cols past the ends as zero
        x = rng.standard_normal((rows, D))
        x[valid_rows:, :] = 0
        x[:, d_valid:] = 0
        return x

    K, V = padded(128, rows_k), padded(128, rows_k)
    Q, dO = padded(P.kBlockM, rows_q), padded(P.kBlockM, rows_q)
    # the global tensors hold NaN past the ends: the producer must never copy it
    def garbage(x, valid_rows):
        g = np.full_like(x, np.nan)
        g[:valid_rows, :d_valid] = x[:valid_rows, :d_valid]
        return g
    Kg, Vg, Qg, dOg = garbage(K, rows_k), garbage(V, rows_k), garbage(Q, rows_q), garbage(dO, rows_q)
    lse = rng.standard_normal(P.kBlockM) + 3.0
    dot = rng.standard_normal(P.kBlockM)
    produce_tile(BASE + P.kK, Kg, 128, rows_k, d_valid)
    produce_tile(BASE + P.kV, Vg, 128, rows_k, d_valid)
    produce_tile(BASE + P.kQ + stage * P.TileQ.bytes, Qg, P.kBlockM, rows_q, d_valid)
    produce_tile(BASE + P.kdO + stage * P.TileQ.bytes, dOg, P.kBlockM, rows_q, d_valid)
    for t in range(128):  # produce_bwd's LSE / dot copies
        for x in range(t, 2 * P.kBlockM, 128):
            is_lse = x < P.kBlockM
            r = x % P.kBlockM
            src = (lse if is_lse else dot)[r if r < rows_q else 0]
            fmem[BASE + (P.kLse if is_lse else P.kDot) + (stage * P.kBlockM + r) * 4] = src if r < rows_q else 0.0
    for lo, n in ((P.kK, 2 * P.TileKV.bytes), (P.kQ + stage * P.TileQ.bytes, P.TileQ.bytes),
                  (P.kdO + stage * P.TileQ.bytes, P.TileQ.bytes)):
        assert not np.isnan(mem[(BASE + lo) // 2:(BASE + lo + n) // 2]).any(), "tile bytes left unwritten"

    def ld(a):
        return mem[a // 2]

    def wgmma_ss(desc_a, desc_b, N, trans_a, trans_b):
        A = np.empty((64, 16))
        B = np.empty((16, N))
        for m, k in itertools.product(range(64), range(16)):
            A[m, k] = ld(addr_mnmajor(desc_a, m, k) if trans_a else addr_kmajor(desc_a, m, k))
        for n, k in itertools.product(range(N), range(16)):
            B[k, n] = ld(addr_mnmajor(desc_b, n, k) if trans_b else addr_kmajor(desc_b, n, k))
        return A @ B

    def wgmma_rs(regs, desc_b, N):  # regs[t][r] = (lo, hi): A register r of thread t
        A = np.full((64, 16), np.nan)
        for t in range(128):
            for r in range(4):
                for h in range(2):
                    m, k = clayout(t, 2 * r + h)
                    A[m, k] = regs[t][r][h]
        assert not np.isnan(A).any()
        B = np.empty((16, N))
        for n, k in itertools.product(range(N), range(16)):
            B[k, n] = ld(addr_mnmajor(desc_b, n, k))
        return A @ B

    def frags(Dm):  # accumulator (64, N) -> per thread values d[v]
        N = Dm.shape[1]
        return [[Dm[clayout(t, v)] for v in range(N // 2)] for t in range(128)]

    def pack_a_frags(s):  # tc::pack_a_frags (16-bit rounding ignored: layout only)
        return [[(s[8 * kk + 2 * r], s[8 * kk + 2 * r + 1]) for r in range(4)] for kk in range(len(s) // 8)]

    n0, m0 = 0, 0  # block-local indices; the reference is per block
    bad = 0
    ref_S = K @ Q.T  # (keys, queries)
    ref_dP = V @ dO.T
    valid = (np.arange(128)[:, None] < rows_k) & (np.arange(P.kBlockM)[None, :] < rows_q)
    lse_q = np.where(np.arange(P.kBlockM) < rows_q, lse, 0.0)
    dot_q = np.where(np.arange(P.kBlockM) < rows_q, dot, 0.0)
    ref_P = np.where(valid, np.exp2(ref_S * scale * log2e - lse_q[None, :] * log2e), 0.0)
    ref_dS = np.where(valid, ref_P * (ref_dP - dot_q[None, :]) * scale, 0.0)
    ref_dV = ref_P @ dO  # (keys, D)
    ref_dK = ref_dS @ Q
    ref_dQ = ref_dS.T @ K  # (queries, D)

    out_dk = np.full((128, D), np.nan)
    out_dv = np.full((128, D), np.nan)
    out_dq = np.zeros((P.kBlockM, D))
    dq_hits = np.zeros((P.kBlockM, D), dtype=int)
    s_ds = BASE + P.kdS + (it & 1) * P.TileS.bytes
    dqs = {}
    for cw in (0, 1):
        d = descriptors(P, cw)
        acc_dk = [[0.0] * (D // 2) for _ in range(128)]
        acc_dv = [[0.0] * (D // 2) for _ in range(128)]
        slot = (stage * P.TileQ.bytes) >> 4
        s_lse = BASE + P.kLse + stage * P.kBlockM * 4
        s_dot = BASE + P.kDot + stage * P.kBlockM * 4
        for sb in range(P.kSub):
            q0 = m0 + 64 * sb
            sub = slot + ((sb * 64 * 128) >> 4)
            S = sum(wgmma_ss(d["k"] + kmajor_step(P.TileKV, kk), d["q"] + sub + kmajor_step(P.TileQ, kk), 64, 0, 0)
                    for kk in range(D // 16))
            dP = sum(wgmma_ss(d["v"] + kmajor_step(P.TileKV, kk), d["do"] + sub + kmajor_step(P.TileQ, kk), 64, 0, 0)
                     for kk in range(D // 16))
            fs, fdp = frags(S), frags(dP)
            pa_all, da_all = [], []
            for t in range(128):
                lane, warp = t & 31, t >> 5
                g, c = lane >> 2, lane & 3
                wk = cw * 64 + warp * 16
                s, dp = fs[t], fdp[t]
                for nt in range(8):  # grads_partial's indices (the full path uses the same)
                    l = (fmem[s_lse + sb * 64 * 4 + (8 * nt + 2 * c) * 4], fmem[s_lse + sb * 64 * 4 + (8 * nt + 2 * c) * 4 + 4])
                    dv = (fmem[s_dot + sb * 64 * 4 + (8 * nt + 2 * c) * 4], fmem[s_dot + sb * 64 * 4 + (8 * nt + 2 * c) * 4 + 4])
                    for e in range(4):
                        i = q0 + 8 * nt + 2 * c + (e & 1)
                        j = n0 + wk + g + (e >> 1) * 8
                        if abs(s[4 * nt + e] - ref_S[j, i]) > 1e-9 or abs(dp[4 * nt + e] - ref_dP[j, i]) > 1e-9:
                            bad += 1
                        if i < rows_q and j < rows_k:  # in_window of a plain, unmasked policy
                            pr = np.exp2(s[4 * nt + e] * scale * log2e - l[e & 1] * log2e)
                            s[4 * nt + e], dp[4 * nt + e] = pr, pr * (dp[4 * nt + e] - dv[e & 1]) * scale
                        else:
                            s[4 * nt + e] = dp[4 * nt + e] = 0.0
                        if abs(s[4 * nt + e] - ref_P[j, i]) > 1e-9 or abs(dp[4 * nt + e] - ref_dS[j, i]) > 1e-9:
                            bad += 1
                pa, da = pack_a_frags(s), pack_a_frags(dp)
                pa_all.append(pa)
                da_all.append(da)
                for kk in range(4):  # the dS^T st.shared.b32
                    for r in range(4):
                        nt, hf = 2 * kk + r // 2, r % 2
                        a = s_ds + P.TileS.offset(wk + g + hf * 8, sb * 64 + nt * 8 + 2 * c)
                        assert a % 4 == 0
                        mem[a // 2], mem[a // 2 + 1] = da[kk][r]
            dV = sum(wgmma_rs([pa_all[t][kk] for t in range(128)], d["do_n"] + sub + ((kk * 16 * 128) >> 4), D)
                     for kk in range(4))
            dK = sum(wgmma_rs([da_all[t][kk] for t in range(128)], d["q_n"] + sub + ((kk * 16 * 128) >> 4), D)
                     for kk in range(4))
            fv, fk = frags(dV), frags(dK)
            for t in range(128):
                for v in range(D // 2):
                    acc_dv[t][v] += fv[t][v]
                    acc_dk[t][v] += fk[t][v]
        dqs[cw] = d
        for t in range(128):  # epilogue
            lane, warp = t & 31, t >> 5
            g, c = lane >> 2, lane & 3
            wk = cw * 64 + warp * 16
            for hf in range(2):
                r = wk + g + hf * 8
                for nt in range(D // 8):
                    col = nt * 8 + 2 * c
                    out_dk[r, col:col + 2] = acc_dk[t][4 * nt + 2 * hf:4 * nt + 2 * hf + 2]
                    out_dv[r, col:col + 2] = acc_dv[t][4 * nt + 2 * hf:4 * nt + 2 * hf + 2]
    bad += int((np.abs(out_dk - ref_dK) > 1e-9).sum() + (np.abs(out_dv - ref_dV) > 1e-9).sum())
    bad += int(np.isnan(out_dk).sum() + np.isnan(out_dv).sum())
    # dQ after the named barrier: both warpgroups' dS^T are in buffer it & 1
    for cw in (0, 1):
        d = dqs[cw]
        acc = sum(wgmma_ss(d["ds"] + (((it & 1) * P.TileS.bytes + kk * 2048) >> 4), d["k_n"] + ((kk * 2048) >> 4),
                           64, 1, 1) for kk in range(8))
        f = frags(acc)
        for t in range(128):  # add_dq
            lane, warp = t & 31, t >> 5
            g, c = lane >> 2, lane & 3
            pt = (t & ~31) | (lane ^ 1)
            even = (c & 1) == 0
            i = m0 + d["dq_row"] + warp * 16 + g + (0 if even else 8)
            for nt in range(8):
                ap = f[pt]  # the partner's s0, s1
                p_even = ((pt & 3) & 1) == 0
                r0 = ap[4 * nt + 2] if p_even else ap[4 * nt]
                r1 = ap[4 * nt + 3] if p_even else ap[4 * nt + 1]
                a = f[t]
                col = d["dq_col"] + nt * 8 + 2 * (c & ~1)
                val = (a[4 * nt], a[4 * nt + 1], r0, r1) if even else (r0, r1, a[4 * nt + 2], a[4 * nt + 3])
                if i < rows_q and col < d_valid:
                    assert col % 4 == 0
                    out_dq[i, col:col + 4] += val
                    dq_hits[i, col:col + 4] += 1
    want_hits = np.zeros_like(dq_hits)
    want_hits[:rows_q, :d_valid] = 1
    bad += int((dq_hits != want_hits).sum())
    bad += int((np.abs(out_dq - np.where(want_hits == 1, ref_dQ, 0.0)) > 1e-9).sum())
    return bad


if __name__ == "__main__":
    bad1, n1 = part1()
    print(f"part 1, descriptor addresses: {bad1} mismatches of {n1} element reads")
    # negative control: the M-major dS^T descriptor with LBO / SBO swapped must be caught
    ctl, _ = part1(swap_ds=True)
    print(f"part 1, control (dS^T descriptor with LBO / SBO swapped): {ctl} mismatches (must be > 0)")
    assert ctl > 0
    bad2 = 0
    for D, stage, it, rows_k, rows_q, d_valid in (
        (64, 0, 0, 128, 128, 64), (64, 1, 1, 77, 100, 40), (64, 1, 0, 128, 33, 64),
        (128, 0, 0, 128, 64, 128), (128, 1, 1, 100, 45, 96), (128, 0, 1, 5, 64, 72),
    ):
        b = part2(D, stage, it, rows_k, rows_q, d_valid, seed=D + 10 * stage + it)
        print(f"part 2, D={D} slot={stage} dS buffer={it} rows_k={rows_k} rows_q={rows_q} d={d_valid}: {b} mismatches")
        bad2 += b
    assert bad1 == 0 and bad2 == 0
