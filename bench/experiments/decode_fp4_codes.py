# Host check of paged_decode_rows.cu's NVFP4 decode (fp4_to_e4m3x8): a table of 8 E4M3 codes per
# block-scale code and byte permutes give, for every scale code and random code words, exactly
# the format's E4M3(clamp(e2m1 * scale, +-448)) (NaN scales: NaN). Run: python bench/experiments/decode_fp4_codes.py
import numpy as np, itertools, struct
def e4m3_val(c):
    s = -1.0 if c & 0x80 else 1.0; e = (c >> 3) & 0xf; m = c & 7
    if e == 0xf and m == 7: return float('nan')
    return s * (m * 2.0**-9 if e == 0 else (1 + m/8) * 2.0**(e-7))
vals = [e4m3_val(c) for c in range(256)]
pos = sorted({v for v in vals if v == v and v >= 0})
def f32_to_e4m3(x):  # RN-even, satfinite, NaN -> 0x7f
    if x != x: return 0x7f
    s = 0x80 if (x < 0 or (x == 0 and str(x).startswith('-'))) else 0
    a = abs(x)
    if a >= 448: return s | 0x7e
    # nearest among pos, ties to even code
    best = None
    for c in range(0x7f):
        v = vals[c]
        d = abs(v - a)
        if best is None or d < best[0] or (d == best[0] and (c & 1) == 0 and (best[1] & 1) == 1): best = (d, c)
    return s | best[1]
E2M1 = [0.0, .5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
def e2m1_val(n): return -E2M1[n & 7] if n & 8 else E2M1[n & 7]
def ref(code_word, bs):
    out = []
    for i in range(8):
        n = (code_word >> (4*i)) & 0xf
        out.append(f32_to_e4m3(np.float32(e2m1_val(n)) * np.float32(vals[bs])))
    return out
def byte_perm(x, y, s):
    src = [(x >> (8*i)) & 0xff for i in range(4)] + [(y >> (8*i)) & 0xff for i in range(4)]
    r = 0
    for i in range(4):
        sel = (s >> (4*i)) & 0xf
        b = src[sel & 7]
        if sel & 8: b = 0xff if b & 0x80 else 0
        r |= b << (8*i)
    return r
lut = []
for bs in range(256):
    codes = [f32_to_e4m3(np.float32(m) * np.float32(vals[bs])) for m in E2M1]
    lut.append((codes[0] | codes[1] << 8 | codes[2] << 16 | codes[3] << 24, codes[4] | codes[5] << 8 | codes[6] << 16 | codes[7] << 24))
def dev(code_word, bs):
    # As the kernel (run 29): magnitudes by permutes of the table entry (selector bit 3 cleared;
    # prmt reads the selector's low 16 bits), signs by sign-replicating permutes of
    # (codes << 4, codes): element 2i's sign is bit 3 of byte i, element 2i + 1's bit 7.
    lx, ly = lut[bs]
    magnitude = code_word & 0x77777777
    mx = byte_perm(lx, ly, magnitude & 0xffff); my = byte_perm(lx, ly, magnitude >> 16)
    even = (code_word << 4) & 0xffffffff
    sx = byte_perm(even, code_word, 0xD9C8); sy = byte_perm(even, code_word, 0xFBEA)
    wx = mx ^ (sx & 0x80808080); wy = my ^ (sy & 0x80808080)
    return [(wx >> (8*i)) & 0xff for i in range(4)] + [(wy >> (8*i)) & 0xff for i in range(4)]
rng = np.random.default_rng(0)
bad = 0
for bs in range(256):
    for _ in range(40):
        w = int(rng.integers(0, 2**32))
        r = ref(w, bs); d = dev(w, bs)
        for a, b in zip(r, d):
            va, vb = vals[a], vals[b]
            if not ((va != va and vb != vb) or a == b):
                bad += 1
                if bad < 5: print("mismatch bs", hex(bs), hex(w), [hex(x) for x in r], [hex(x) for x in d])
print("mismatches:", bad)
assert bad == 0, "NVFP4 decode differs from the format"
