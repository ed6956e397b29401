# Host emulation of paged_decode_rows.cu's fragment layouts for one warp (one query row's 16 heads,
# one page): the 128-byte swizzled codes, the 8-byte loads, byte permutes, E4M3 -> f16 conversions,
# m16n8k16 fragments and the epilogue's dims, checked against S = Q K^T and O = P V in float64.
# Run: python bench/experiments/decode_rows_fragments.py (prints the largest errors; ~1e-12).
import numpy as np
rng = np.random.default_rng(1)

def e4m3_decode(c):
    c = int(c); s = -1.0 if c & 0x80 else 1.0; e = (c >> 3) & 0xf; m = c & 7
    if e == 0xf and m == 7: return np.nan
    if e == 0: return s * m * 2.0**-9
    return s * (1 + m / 8) * 2.0**(e - 7)

codes_all = np.array([e4m3_decode(c) for c in range(256)])

def swz(t, b): return t * 128 + ((((b >> 4) ^ (t & 7))) << 4) + (b & 15)

# a page: K, V codes [128 tokens][128 dims]
Kc = rng.integers(0, 256, size=(128, 128)); Vc = rng.integers(0, 256, size=(128, 128))
Kc[(Kc & 0x7f) == 0x7f] = 0x10; Vc[(Vc & 0x7f) == 0x7f] = 0x10  # no NaN codes
ks = np.zeros(128 * 128, dtype=np.int64); vs = np.zeros(128 * 128, dtype=np.int64)
for t in range(128):
    for b in range(128):
        ks[swz(t, b)] = Kc[t, b]; vs[swz(t, b)] = Vc[t, b]
def ld8(side, t, b):  # 8 codes as two little-endian words
    base = swz(t, b); assert swz(t, b + 7) == base + 7
    bs = side[base:base + 8]
    w = lambda o: int(bs[o]) | int(bs[o+1]) << 8 | int(bs[o+2]) << 16 | int(bs[o+3]) << 24
    return (w(0), w(4))
def cvt(x):  # low 16 bits: two codes -> (lo, hi) values
    return (codes_all[x & 0xff], codes_all[(x >> 8) & 0xff])
def byte_perm(x, y, s):
    src = [(x >> (8*i)) & 0xff for i in range(4)] + [(y >> (8*i)) & 0xff for i in range(4)]
    r = 0
    for i in range(4): r |= src[(s >> (4*i)) & 7] << (8*i)
    return r

Q = rng.standard_normal((16, 128)).astype(np.float32)  # 16 heads
def mma(C, afr, bfr):
    # afr[lane] = 4 regs each a (lo, hi) pair; bfr[lane] = 2 regs; C[lane] = 4 floats
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for lane in range(32):
        q, gid = lane & 3, lane >> 2
        a = afr[lane]
        A[gid, 2*q:2*q+2] = a[0]; A[gid+8, 2*q:2*q+2] = a[1]; A[gid, 2*q+8:2*q+10] = a[2]; A[gid+8, 2*q+8:2*q+10] = a[3]
        b = bfr[lane]
        B[2*q:2*q+2, gid] = b[0]; B[2*q+8:2*q+10, gid] = b[1]
    D = A @ B
    for lane in range(32):
        q, gid = lane & 3, lane >> 2
        C[lane][0] += D[gid, 2*q]; C[lane][1] += D[gid, 2*q+1]; C[lane][2] += D[gid+8, 2*q]; C[lane][3] += D[gid+8, 2*q+1]

# load_query (no f16 rounding: scale only)
qa = [[None]*4 for _ in range(8)]
qa = [[[None]*4 for _ in range(8)] for _ in range(32)]
for lane in range(32):
    q, gid = lane & 3, lane >> 2
    v = [[Q[gid + 8*h, 32*p + 8*q: 32*p + 8*q + 8] for p in range(4)] for h in range(2)]
    for kk in range(8):
        p, o = kk // 2, 4 * (kk % 2)
        qa[lane][kk] = [(v[0][p][o], v[0][p][o+1]), (v[1][p][o], v[1][p][o+1]), (v[0][p][o+2], v[0][p][o+3]), (v[1][p][o+2], v[1][p][o+3])]
# page_scores
s = [[[0.0]*4 for _ in range(32)] for _ in range(16)]
for j in range(16):
    for p in range(4):
        for half in range(2):
            bfr = []
            for lane in range(32):
                q, gid = lane & 3, lane >> 2
                w = ld8(ks, 8*j + gid, 32*p + 8*q)[half]
                bfr.append((cvt(w), cvt(w >> 16)))
            mma(s[j], [qa[lane][2*p + half] for lane in range(32)], bfr)
S_ref = Q.astype(np.float64) @ codes_all[Kc].T  # [16 heads][128 keys]
S_emu = np.zeros((16, 128))
for j in range(16):
    for lane in range(32):
        q, gid = lane & 3, lane >> 2
        S_emu[gid, 8*j + 2*q] = s[j][lane][0]; S_emu[gid, 8*j + 2*q + 1] = s[j][lane][1]
        S_emu[gid+8, 8*j + 2*q] = s[j][lane][2]; S_emu[gid+8, 8*j + 2*q + 1] = s[j][lane][3]
print("S max abs err", np.abs(S_emu - S_ref).max())
assert np.abs(S_emu - S_ref).max() <= 1e-9 * np.abs(S_ref).max(), "S layout"

# P V with a random P (16 heads x 128 keys), limit
for limit in (128, 77):
    P = rng.random((16, 128)); P[:, limit:] = 0
    pa = []
    for lane in range(32):
        q, gid = lane & 3, lane >> 2
        pl = []
        for c in range(8):
            # pa[c] from p[2c][..], p[2c+1][..] in S's C layout: keys 16c + 2q (+1), 16c + 8 + 2q (+1)
            pl.append([(P[gid, 16*c+2*q], P[gid, 16*c+2*q+1]), (P[gid+8, 16*c+2*q], P[gid+8, 16*c+2*q+1]),
                       (P[gid, 16*c+8+2*q], P[gid, 16*c+8+2*q+1]), (P[gid+8, 16*c+8+2*q], P[gid+8, 16*c+8+2*q+1])])
        pa.append(pl)
    o = [[[0.0]*4 for _ in range(32)] for _ in range(16)]
    for c in range(8):
        if c * 16 >= limit: break
        for hh in range(2):
            for half in range(2):
                for i in (0, 2):
                    for e in range(2):
                        bfr = []
                        for lane in range(32):
                            q, gid = lane & 3, lane >> 2
                            k0 = 16*c + 2*q; d0 = 64*hh + 8*gid
                            w = [ld8(vs, k, d0) for k in (k0, k0+1, k0+8, k0+9)]
                            a0, a1, a2, a3 = (ww[half] for ww in w)
                            sel = i | (i+4) << 4 | (i+1) << 8 | (i+5) << 12
                            lo = byte_perm(a0, a1, sel); hi = byte_perm(a2, a3, sel)
                            b0 = cvt(lo >> (16*e)); b1 = cvt(hi >> (16*e))
                            keep = lambda t: t < limit
                            b0 = (b0[0] if keep(k0) else 0.0, b0[1] if keep(k0+1) else 0.0)
                            b1 = (b1[0] if keep(k0+8) else 0.0, b1[1] if keep(k0+9) else 0.0)
                            bfr.append((b0, b1))
                        mma(o[8*hh + 4*half + i + e], [pa[lane][c] for lane in range(32)], bfr)
    O_ref = P @ codes_all[Vc]
    O_emu = np.zeros((16, 128))
    for lane in range(32):
        q, gid = lane & 3, lane >> 2
        for h in range(2):
            for hh in range(2):
                for col in range(2):
                    d0 = 64*hh + 16*q + 8*col
                    for i in range(8):
                        O_emu[gid + 8*h, d0 + i] = o[8*hh + i][lane][2*h + col]
    print("limit", limit, "O max abs err", np.abs(O_emu - O_ref).max(), "rel", np.abs(O_emu - O_ref).max() / np.abs(O_ref).max())
    assert np.abs(O_emu - O_ref).max() <= 1e-9 * np.abs(O_ref).max(), "P V layout"
