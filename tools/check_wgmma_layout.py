#!/usr/bin/env python3
# CPU check of the sm_90a wgmma forward's layout math (no GPU): emulates the wgmma shared-memory
# address generation of the SW128 K-major / MN-major descriptors the kernel builds (canonical forms
# as in CUTLASS make_gmma_desc) and compares with wg::Sw128Tile::offset, and checks the accumulator /
# A-register fragment layouts (CUTLASS CLayout_64xN, ALayout_64x16) against mma.cuh's assumptions.
# Emulates wgmma's shared-memory address generation for SW128 descriptors (CUTLASS canonical forms,
# cute/atom/mma_traits_sm90_gmma.hpp make_gmma_desc) and compares with Sw128Tile::offset.
def sw128(addr):                       # Swizzle<3,4,3> on byte addresses: bits[4:6] ^= bits[7:9]
    return addr ^ (((addr >> 7) & 7) << 4)
def tile_off(kRows, r, col):           # wgmma.cuh Sw128Tile::offset
    c = col >> 3
    return (c >> 3) * kRows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4) + (col & 7) * 2
def kmajor(start, sbo, mn, k):         # ((8,n),2):((8,SBO),1) in 16-B units, + byte in chunk
    return sw128(start + (mn % 8) * 128 + (mn // 8) * sbo + (k // 8) * 16 + (k % 8) * 2)
def mnmajor(start, lbo, sbo, mn, k):   # ((8,n),(8,k)):((1,LBO),(8,SBO)) in 16-B units
    return sw128(start + ((mn % 64) // 8) * 16 + (mn % 8) * 2 + (mn // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo)
base = 1024 * 37  # any 1024-aligned base
bad = 0
for kD in (64, 128):
    kBlockN, kBlockM = 128, 128
    # S = Q K^T: A = Q rows [64cw, 64cw+64), B = K (128 keys), K-major, k-step kk
    for cw in (0, 1):
        for kk in range(kD // 16):
            step = (kk >> 2) * kBlockM * 128 + (kk & 3) * 32
            sq = base + cw * 64 * 128 + step
            for m in range(64):
                for k in range(16):
                    if kmajor(sq, 1024, m, k) != base + tile_off(kBlockM, 64 * cw + m, 16 * kk + k): bad += 1
    for slot in range(3):
        for kk in range(kD // 16):
            sk = base + slot * kBlockN * kD * 2 + (kk >> 2) * kBlockN * 128 + (kk & 3) * 32
            for n in range(kBlockN):
                for k in range(16):
                    if kmajor(sk, 1024, n, k) != base + slot * kBlockN * kD * 2 + tile_off(kBlockN, n, 16 * kk + k): bad += 1
    # O += P V: B = V (keys = K, head dim = N), N-major, LBO = kBlockN*128, SBO = 1024, k-step kk: +2048
    for slot in range(3):
        for kk in range(kBlockN // 16):
            sv = base + slot * kBlockN * kD * 2 + kk * 2048
            for n in range(kD):
                for k in range(16):
                    if mnmajor(sv, kBlockN * 128, 1024, n, k) != base + slot * kBlockN * kD * 2 + tile_off(kBlockN, 16 * kk + k, n): bad += 1
print("mismatches:", bad)
# accumulator d[4nt+e] (CUTLASS CLayout_64xN: ((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512)), index m + 64 n)
# and A-from-registers ALayout_64x16 (same strides, N/8 = 2) vs the mma.m16n8k16 layouts the kernel assumes
def clayout(t, v, N):
    c, g, w = t % 4, (t // 4) % 8, t // 32
    v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
    idx = c * 128 + g + w * 16 + v0 * 64 + v1 * 8 + v2 * 512
    return idx % 64, idx // 64      # (row m, col n)
badf = 0
for t in range(128):
    g, c, w = (t % 32) >> 2, t & 3, t // 32
    for v in range(64):                      # N = 128 accumulator
        nt, e = v // 4, v % 4
        if clayout(t, v, 128) != (16 * w + g + 8 * (e >> 1), 8 * nt + 2 * c + (e & 1)): badf += 1
    for v in range(8):                       # A 64x16 from registers: reg r = v // 2, half = v % 2
        r, half = v // 2, v % 2
        want = (16 * w + g + 8 * (r & 1), 2 * c + half + 8 * (r >> 1))   # mma.m16n8k16 A: a0..a3
        if clayout(t, v, 16) != want: badf += 1
print("fragment mismatches:", badf)
# pack_a_frags: pa[kk][r] = pack(s[8kk+2r], s[8kk+2r+1]) must be A fragment register r of k-step kk
badp = 0
for t in range(128):
    g, c, w = (t % 32) >> 2, t & 3, t // 32
    for kk in range(8):
        for r in range(4):
            for half in range(2):
                v = 8 * kk + 2 * r + half
                m, n = clayout(t, v, 128)                       # where that S value lives
                am, ak = clayout(t, 2 * r + half, 16)           # where A register r expects it
                if (m, n) != (am, 16 * kk + ak): badp += 1
print("pack mismatches:", badp)
assert bad == 0 and badf == 0 and badp == 0
