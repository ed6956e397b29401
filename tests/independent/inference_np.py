"""Float64 NumPy oracle of MSA inference over paged caches, written from the specification
(docs/semantics.md §9: paged caches, decode / chunked-prefill positions, FP8 and NVFP4 caches)
and docs/inference.md (tensor names, layouts, scales), without reference to the C++ code.

Rows: query row r belongs to request b and sits at position p = seq_lens[b] - q_len_b + i
(decode: q_len_b = Q for every request; paged prefill: from cu_seqlens_q). A row with p < 0
(padding request, seq_len 0) sees nothing. Logical page j of request b lives in physical page
page_table[b, j]; token t of the request is slot (page_table[b, t // 128], t % 128).
"""

import math

import numpy as np

PAGE = 128
TOPK = 16
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ------------------------------------------------------------------------------------------
# FP8 E4M3 (the "fn" variant: bias 7, no infinities, S.1111.111 is NaN, max 448)


def _e4m3_table():
    values = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent, mantissa = (code >> 3) & 0xF, code & 0x7
        if exponent == 0xF and mantissa == 0x7:
            values[code] = np.nan
        elif exponent == 0:
            values[code] = sign * mantissa / 8.0 * 2.0**-6
        else:
            values[code] = sign * (1.0 + mantissa / 8.0) * 2.0 ** (exponent - 7)
    return values


E4M3_VALUES = _e4m3_table()  # code -> value
_E4M3_MAGNITUDES = E4M3_VALUES[:127]  # codes 0..126: the finite non-negative values, increasing


def e4m3_decode(codes):
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def e4m3_encode(x):
    """float -> E4M3 code: round to nearest, ties to the even code, saturating at +-448, NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    finite = np.isfinite(a)
    a = np.where(finite, np.minimum(a, 448.0), 0.0)
    lo = np.clip(np.searchsorted(_E4M3_MAGNITUDES, a, side="right") - 1, 0, 126)
    hi = np.minimum(lo + 1, 126)
    down, up = a - _E4M3_MAGNITUDES[lo], _E4M3_MAGNITUDES[hi] - a
    code = np.where(up < down, hi, lo)
    tie = (up == down) & (hi != lo)
    code = np.where(tie, np.where(lo % 2 == 0, lo, hi), code).astype(np.uint8)
    code = code | np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    code[~finite & np.isnan(x)] = 0x7F
    return code


# ------------------------------------------------------------------------------------------
# NVFP4: two E2M1 codes per byte (element 2i in the low nibble), one E4M3 scale per 16 elements


def nvfp4_decode(packed, block_scales, global_scale=1.0):
    """packed uint8 [..., 64], block_scales E4M3 codes [..., 8] -> float64 [..., 128].
    value = E4M3(clamp(e2m1 * block_scale, -448, 448)) * global_scale."""
    packed = np.asarray(packed, dtype=np.uint8)
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
    e2m1 = np.where(nibbles & 0x8, -1.0, 1.0) * E2M1[nibbles & 0x7]
    scale = np.repeat(e4m3_decode(block_scales), 16, axis=-1)
    with np.errstate(invalid="ignore"):
        product = np.clip(e2m1 * scale, -448.0, 448.0)  # NaN stays NaN
    return e4m3_decode(e4m3_encode(product)) * global_scale


def nvfp4_encode(x):
    """float64 [..., 128] -> (packed uint8 [..., 64], block scale codes [..., 8]); the input
    generator only: block scale = E4M3(max|x| / 6), codes = nearest E2M1 of x / scale."""
    blocks = x.reshape(x.shape[:-1] + (8, 16))
    sf_codes = e4m3_encode(np.max(np.abs(blocks), axis=-1) / 6.0)
    sf = e4m3_decode(sf_codes)[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(sf > 0, blocks / sf, 0.0)
    magnitude = np.argmin(np.abs(np.abs(y)[..., None] - E2M1), axis=-1)
    codes = (magnitude | np.where(y < 0, 8, 0)).astype(np.uint8).reshape(x.shape)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, sf_codes


# ------------------------------------------------------------------------------------------
# Rows, dequantised caches, selection and attention


def rows_of(mode, seq_lens, total_q, cu_seqlens_q=None, q_len_per_req=None):
    """[(request, position)] for every query row."""
    rows = []
    if mode == "decode":
        for b, n in enumerate(seq_lens):
            rows += [(b, int(n) - q_len_per_req + i) for i in range(q_len_per_req)]
    else:
        for b, n in enumerate(seq_lens):
            q_len = int(cu_seqlens_q[b + 1] - cu_seqlens_q[b])
            rows += [(b, int(n) - q_len + i) for i in range(q_len)]
    assert len(rows) == total_q
    return rows


def token_slots(page_table_row, count):
    """(physical page, offset) arrays of a request's tokens 0..count-1."""
    t = np.arange(count)
    return page_table_row[t // PAGE], t % PAGE


def page_scores(index_q_row, index_k, page_table_row, history_pages):
    """Max over each history page's 128 tokens of <index_q, index_k>: [Hi, history_pages]."""
    if history_pages == 0:
        return np.zeros((index_q_row.shape[0], 0))
    keys = index_k[page_table_row[:history_pages]]  # [n, 128, D]
    s = np.einsum("hd,ntd->hnt", index_q_row, keys)
    return s.max(axis=-1)


def select(scores_row, position):
    """Selection of one (row, index head): (set, ranked history list)."""
    if position < 0:
        return set(), []
    local = position // PAGE
    if local + 1 <= TOPK:
        return set(range(local + 1)), []
    keyed = sorted((-s if not math.isnan(s) else math.inf, j) for j, s in enumerate(scores_row[:local]))
    ranked = [j for key, j in keyed[: TOPK - 1] if key != math.inf]
    return set(ranked) | {local}, ranked


def attention_row(q_row, k, v, page_table_row, position, pages, scale):
    """q_row [G, D] (the query heads of one KV head); k, v [phys, 128, D] of that KV head.
    Keys: tokens t <= position of the given logical pages. Returns (out [G, D], lse [G])."""
    tokens = np.concatenate([np.arange(j * PAGE, min(j * PAGE + PAGE, position + 1)) for j in pages]) if pages else []
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.size == 0:
        return np.zeros_like(q_row), np.full(q_row.shape[0], -np.inf)
    phys, off = token_slots(page_table_row, position + 1)
    K, V = k[phys[tokens], off[tokens]], v[phys[tokens], off[tokens]]  # [n, D]
    z = q_row @ K.T * scale
    m = z.max(axis=1, keepdims=True)
    p = np.exp(z - m)
    total = p.sum(axis=1, keepdims=True)
    return (p @ V) / total, (np.log(total) + m)[:, 0]
