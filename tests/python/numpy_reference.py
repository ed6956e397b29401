"""Float64 NumPy oracle of MSA (spec §3-§5), written from the spec independently of the
library: dense per-document masks, no blocking tricks. Small inputs only."""

import numpy as np

BLOCK = 128
TOPK = 16


def documents(layout):
    """(q_start, q_len, k_start, k_len) per document."""
    return list(layout.documents)


def block_scores(iq_g, ik, pos, block=BLOCK):
    """Max-pooled index scores S[i, b] over the causally visible tokens of block b (-inf when
    none). iq_g [n, D], ik [k_len, D], pos [n]."""
    s = iq_g @ ik.T  # [n, k_len]
    k_len = ik.shape[0]
    t = np.arange(k_len)
    s = np.where(t[None, :] <= pos[:, None], s, -np.inf)
    nblocks = (k_len + block - 1) // block
    pad = nblocks * block - k_len
    s = np.pad(s, ((0, 0), (0, pad)), constant_values=-np.inf)
    with np.errstate(invalid="ignore"):
        return s.reshape(len(pos), nblocks, block).max(axis=2)


def select_blocks(iq, ik, layout, topk=TOPK, init_blocks=0, local_blocks=1, block=BLOCK):
    """Selection per (index head, query row) as a list of ids, plus the block scores used.
    iq [total_q, Hi, D], ik [total_k, 1, D] (float64)."""
    hi = iq.shape[1]
    total_q = iq.shape[0]
    sel = [[None] * total_q for _ in range(hi)]
    scores = [[None] * total_q for _ in range(hi)]
    for q0, qn, k0, kn in documents(layout):
        pos = kn - qn + np.arange(qn)
        keys = ik[k0:k0 + kn, 0]
        for g in range(hi):
            S = block_scores(iq[q0:q0 + qn, g], keys, pos, block)
            for i in range(qn):
                local = pos[i] // block
                nvis = local + 1
                forced = sorted(set(range(min(init_blocks, nvis))) | set(range(max(0, nvis - local_blocks), nvis)))
                count = min(topk, nvis)
                free = [b for b in range(nvis) if b not in forced and not np.isnan(S[i, b])]
                free.sort(key=lambda b: (-S[i, b], b))
                chosen = [b for b in forced if b < nvis - local_blocks] + free[:count - len(forced)]
                chosen += [b for b in forced if b >= nvis - local_blocks]
                sel[g][q0 + i] = chosen
                scores[g][q0 + i] = S[i]
    return sel, scores


def topk_to_sets(topk):
    """int32 [H, total_q, 16] -> list of lists of valid ids."""
    return [[[int(b) for b in row if b >= 0] for row in head] for head in topk]


def _mask(sel_rows, pos, k_len, block=BLOCK):
    """Boolean [n, k_len]: key t is in a selected block and t <= pos."""
    t = np.arange(k_len)
    m = np.zeros((len(pos), k_len), dtype=bool)
    for i, blocks in enumerate(sel_rows):
        for b in blocks:
            m[i, b * block:(b + 1) * block] = True
    return m & (t[None, :] <= pos[:, None])


def _softmax(z, mask):
    z = np.where(mask, z, -np.inf)
    m = z.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.where(mask, np.exp(z - m_safe), 0.0)
    s = e.sum(axis=-1, keepdims=True)
    p = np.where(s > 0, e / np.where(s > 0, s, 1), 0.0)
    lse = np.where(s[..., 0] > 0, np.log(np.where(s[..., 0] > 0, s[..., 0], 1)) + m_safe[..., 0], -np.inf)
    return p, lse


def attention(q, k, v, topk, layout, scale=None):
    """out [total_q, Hq, D], lse [total_q, Hq] and the probabilities per document/head."""
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    sets = topk_to_sets(topk)
    out = np.zeros((total_q, hq, d))
    lse = np.full((total_q, hq), -np.inf)
    probs = {}
    for doc, (q0, qn, k0, kn) in enumerate(documents(layout)):
        pos = kn - qn + np.arange(qn)
        for g in range(hkv):
            mask = _mask(sets[g][q0:q0 + qn], pos, kn)
            for h in range(g * group, (g + 1) * group):
                z = scale * q[q0:q0 + qn, h] @ k[k0:k0 + kn, g].T
                p, l = _softmax(z, mask)
                out[q0:q0 + qn, h] = p @ v[k0:k0 + kn, g]
                lse[q0:q0 + qn, h] = l
                probs[doc, h] = p
    return out, lse, probs


def attention_backward(dout, q, k, v, topk, out, layout, scale=None):
    total_q, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    _, _, probs = attention(q, k, v, topk, layout, scale)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for doc, (q0, qn, k0, kn) in enumerate(documents(layout)):
        for h in range(hq):
            g = h // group
            p = probs[doc, h]
            do = dout[q0:q0 + qn, h]
            dp = do @ v[k0:k0 + kn, g].T
            delta = (do * out[q0:q0 + qn, h]).sum(-1, keepdims=True)
            ds = p * (dp - delta)
            dq[q0:q0 + qn, h] = scale * ds @ k[k0:k0 + kn, g]
            dk[k0:k0 + kn, g] += scale * ds.T @ q[q0:q0 + qn, h]
            dv[k0:k0 + kn, g] += p.T @ do
    return dq, dk, dv


def selected_lse(iq, ik, topk, layout, index_scale=None):
    """LSE [Hi, total_q] of index_scale * <iq, ik> over the selected causal keys."""
    total_q, hi, di = iq.shape
    index_scale = di ** -0.5 if index_scale is None else index_scale
    sets = topk_to_sets(topk)
    out = np.full((hi, total_q), -np.inf)
    for q0, qn, k0, kn in documents(layout):
        pos = kn - qn + np.arange(qn)
        for g in range(hi):
            mask = _mask(sets[g][q0:q0 + qn], pos, kn)
            _, l = _softmax(index_scale * iq[q0:q0 + qn, g] @ ik[k0:k0 + kn, 0].T, mask)
            out[g, q0:q0 + qn] = l
    return out


def kl_backward(q, k, iq, ik, topk, layout, grad_scale=None, scale=None, index_scale=None):
    """d index_q, d index_k of KL(teacher || student) (teacher: mean over the group's heads of
    the main attention probabilities; student: softmax of the index scores; both over the
    selected causal keys), scaled by grad_scale (default 1 / (Hi * total_q))."""
    total_q, hq, d = q.shape
    hi, di = iq.shape[1], iq.shape[2]
    group = hq // hi
    index_scale = di ** -0.5 if index_scale is None else index_scale
    grad_scale = 1.0 / (hi * total_q) if not grad_scale else grad_scale
    _, _, probs = attention(q, k, k, topk, layout, scale)
    sets = topk_to_sets(topk)
    diq, dik = np.zeros_like(iq), np.zeros_like(ik)
    for doc, (q0, qn, k0, kn) in enumerate(documents(layout)):
        pos = kn - qn + np.arange(qn)
        for g in range(hi):
            mask = _mask(sets[g][q0:q0 + qn], pos, kn)
            teacher = np.mean([probs[doc, h] for h in range(g * group, (g + 1) * group)], axis=0)
            student, _ = _softmax(index_scale * iq[q0:q0 + qn, g] @ ik[k0:k0 + kn, 0].T, mask)
            ds = (student - teacher) * grad_scale
            diq[q0:q0 + qn, g] = index_scale * ds @ ik[k0:k0 + kn, 0]
            dik[k0:k0 + kn, 0] += index_scale * ds.T @ iq[q0:q0 + qn, g]
    return diq, dik


def merge_states(out_partials, lse_partials):
    m = lse_partials.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.where(np.isfinite(lse_partials), np.exp(lse_partials - m_safe), 0.0)
    z = w.sum(axis=0)
    out = np.where(z[..., None] > 0, (w[..., None] * out_partials).sum(0) / np.where(z > 0, z, 1)[..., None], 0.0)
    lse = np.where(z > 0, np.log(np.where(z > 0, z, 1)) + m_safe, -np.inf)
    return out, lse


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
