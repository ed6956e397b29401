"""The float64 NumPy oracle of MiniMax Sparse Attention: the ground truth of the numerical
contract (docs/semantics.md; which reference is authoritative for what: docs/architecture.md).
Written from the contract without reference to the C++ code, dense per-document masks, no
blocking tricks; small inputs only. Used by the independent run-case check (check_cases.py)
and, through the thin layout adapter tests/python/numpy_reference.py, by the Python tests.
The inference path (paged caches, FP8 / NVFP4) is in inference_np.py.

Conventions (docs/semantics.md §2): packed query rows and key rows; document b owns queries
[cu_q[b], cu_q[b+1]) and keys [cu_k[f], cu_k[b+1]) with f = fragment_indices[b] (b without
fragments); query i of a document sits at causal position p = k_len - q_len + i. Block ids are
document-local, block b holds document tokens [128 b, 128 b + 128). Query head h uses KV head
and index head g = h // (Hq // Hkv).
"""

import math

import numpy as np

BLOCK = 128
TOPK = 16
INIT_SENTINEL = 1e30
LOCAL_SENTINEL = 1e29


class Doc:
    def __init__(self, q_start, q_len, k_start, k_len):
        self.q_start, self.q_len, self.k_start, self.k_len = q_start, q_len, k_start, k_len

    def positions(self):
        return np.arange(self.q_len) + (self.k_len - self.q_len)


def documents(cu_q, cu_k, fragments=None):
    """The documents of cu_seqlens_q / cu_seqlens_k (+ fragment_indices)."""
    docs = []
    for b in range(len(cu_q) - 1):
        f = b if fragments is None else int(fragments[b])
        k_start = int(cu_k[f])
        docs.append(Doc(int(cu_q[b]), int(cu_q[b + 1] - cu_q[b]), k_start, int(cu_k[b + 1]) - k_start))
    return docs


def documents_of(layout):
    """The documents of an object with a `documents` list of (q_start, q_len, k_start, k_len)
    (msa.PackedLayout in Python)."""
    return [Doc(int(q0), int(qn), int(k0), int(kn)) for q0, qn, k0, kn in layout.documents]


class Settings:
    def __init__(self, init_blocks=0, local_blocks=1, softmax_scale=None, index_scale=None, lse_temperature=1.0,
                 kl_grad_scale=None, head_dim=128):
        self.init_blocks = init_blocks
        self.local_blocks = local_blocks
        self.softmax_scale = softmax_scale if softmax_scale else 1.0 / math.sqrt(head_dim)
        self.index_scale = index_scale if index_scale else 1.0 / math.sqrt(head_dim)
        self.lse_temperature = lse_temperature
        self.kl_grad_scale = kl_grad_scale  # None or 0: 1 / (Hi * total_q)


# ------------------------------------------------------------------------------------------
# Indexer (docs/semantics.md §3)


def index_scores(doc, index_q, index_k, settings):
    """s[g, i, t] = index_scale <qi_g(p_i), ki(t)> for t <= p_i, else -inf. [Hi, q_len, k_len]."""
    qi = index_q[doc.q_start : doc.q_start + doc.q_len]  # [n, Hi, D]
    ki = index_k[doc.k_start : doc.k_start + doc.k_len, 0]  # [kl, D]
    s = np.stack([qi[:, g] @ ki.T for g in range(qi.shape[1])]) * settings.index_scale
    causal = np.arange(doc.k_len)[None, :] <= doc.positions()[:, None]
    return np.where(causal[None], s, -np.inf)


def block_scores(scores, k_len):
    """Max-pool of token scores per 128-key block: [Hi, n, nblocks]; NaN if any token is NaN."""
    nblocks = (k_len + BLOCK - 1) // BLOCK
    padded = np.full(scores.shape[:2] + (nblocks * BLOCK,), -np.inf)
    padded[..., :k_len] = scores
    blocks = padded.reshape(scores.shape[:2] + (nblocks, BLOCK))
    out = blocks.max(axis=-1)
    out[np.isnan(blocks).any(axis=-1)] = np.nan
    return out


def select_row(block_row, p, settings):
    """Selection of one (query, index head) from its block scores.

    Returns (selected set, forced set, ranked list, nvis)."""
    nvis = p // BLOCK + 1
    count = min(TOPK, nvis)
    if nvis <= TOPK:
        every = list(range(nvis))
        return set(every), set(every), [], nvis
    local = set(range(max(0, nvis - settings.local_blocks), nvis))
    init = set(range(min(settings.init_blocks, nvis))) - local  # local wins where both apply
    keyed = []
    for b in range(nvis):
        if b in local:
            score = LOCAL_SENTINEL
        elif b in init:
            score = INIT_SENTINEL
        else:
            score = block_row[b]
            if math.isnan(score):
                score = -math.inf  # NaN is never selected unless forced
        keyed.append((-score, b))
    keyed.sort()
    chosen = [b for key, b in keyed[:count] if key != math.inf]  # NaN-scored blocks stay unselected
    forced = init | local
    ranked = [b for b in chosen if b not in forced]
    return set(chosen), forced & set(chosen), ranked, nvis


def ordered_selection(block_row, p, settings):
    """The valid ids of one (query, index head) in the contract's order (docs/semantics.md
    §3.3): all visible blocks ascending when there are at most 16; else init blocks ascending,
    ranked history in rank order, the other local blocks ascending, the own block last."""
    chosen, forced, ranked, nvis = select_row(block_row, p, settings)
    if nvis <= TOPK:
        return sorted(chosen)
    first_local = max(0, nvis - settings.local_blocks)
    init = sorted(b for b in forced if b < first_local)
    local = sorted(b for b in forced if b >= first_local)
    return init + ranked + local


def select_blocks(docs, index_q, index_k, settings, total_q):
    """Selection of every (index head, query row): (ids [Hi][total_q] lists in contract order,
    block scores [Hi][total_q] arrays of the row's block scores)."""
    hi = index_q.shape[1]
    ids = [[None] * total_q for _ in range(hi)]
    scores = [[None] * total_q for _ in range(hi)]
    for doc in docs:
        if doc.q_len == 0:
            continue
        blocks = block_scores(index_scores(doc, index_q, index_k, settings), doc.k_len)
        for i, p in enumerate(doc.positions()):
            for g in range(hi):
                ids[g][doc.q_start + i] = ordered_selection(blocks[g, i], int(p), settings)
                scores[g][doc.q_start + i] = blocks[g, i]
    return ids, scores


def topk_to_sets(topk):
    """int32 [H, total_q, 16] -> per head, per row, the list of valid ids."""
    return [[[int(b) for b in row if b >= 0] for row in head] for head in topk]


def selected_keys_mask(positions, k_len, topk_rows):
    """mask[i, t]: key t (< k_len) is in a selected block of query i and t <= positions[i].
    topk_rows: [n, 16] document-local block ids, -1 padded."""
    n = len(positions)
    block_of_key = np.arange(k_len) // BLOCK
    nblocks = (k_len + BLOCK - 1) // BLOCK
    chosen = np.zeros((n, nblocks + 1), dtype=bool)
    rows = np.repeat(np.arange(n), topk_rows.shape[1])
    ids = topk_rows.reshape(-1)
    valid = (ids >= 0) & (ids <= nblocks)
    chosen[rows[valid], ids[valid]] = True
    causal = np.arange(k_len)[None, :] <= np.asarray(positions)[:, None]
    return chosen[:, block_of_key] & causal


def logsumexp(x, axis):
    m = np.max(x, axis=axis, keepdims=True)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(x - safe), axis=axis, keepdims=True)) + safe
    return np.squeeze(out, axis=axis)


def selected_lse(doc, index_q, index_k, topk, settings, temperature):
    """[Hi, n]: logsumexp over the selected causal keys of s / temperature (-inf if none)."""
    s = index_scores(doc, index_q, index_k, settings)
    out = np.empty(s.shape[:2])
    for g in range(s.shape[0]):
        mask = selected_keys_mask(doc.positions(), doc.k_len, topk[g, doc.q_start : doc.q_start + doc.q_len])
        out[g] = logsumexp(np.where(mask, s[g] / temperature, -np.inf), axis=1)
    return out


def selected_lse_all(docs, index_q, index_k, topk, settings, temperature, total_q):
    """[Hi, total_q]: selected_lse of every document (-inf for rows without keys)."""
    out = np.full((index_q.shape[1], total_q), -np.inf)
    for doc in docs:
        if doc.q_len:
            out[:, doc.q_start : doc.q_start + doc.q_len] = selected_lse(doc, index_q, index_k, topk, settings, temperature)
    return out


# ------------------------------------------------------------------------------------------
# Attention forward / backward (docs/semantics.md §4, §6) and KL (§7)


def attention_and_kl(docs, q, k, v, index_q, index_k, topk, dout, settings, total_q, want_backward, given_out=None):
    """Forward (out [Tq, Hq, D], lse [Tq, Hq]) and, when want_backward, dq, dk, dv and the KL
    gradients dindex_q [Tq, Hi, D], dindex_k [Tk, 1, D] (left out when index_q is None).
    `topk` is the selection to use.

    The backward's rowsum(dO o O) uses `given_out` when given: a backward receives the
    forward's (bf16) output as an input, exactly as in training, and for rows with few keys
    (dq of a one-key row is 0 with the exact O) that input decides the result."""
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    with_kl = index_q is not None
    Hi = index_q.shape[1] if with_kl else 0
    G = Hq // Hkv
    scale = settings.softmax_scale
    out = np.zeros((Tq, Hq, D))
    lse = np.full((Tq, Hq), -np.inf)
    grads = None
    if want_backward:
        grads = {
            "dq": np.zeros((Tq, Hq, D)),
            "dk": np.zeros((Tk, Hkv, D)),
            "dv": np.zeros((Tk, Hkv, D)),
        }
        if with_kl:
            grads["dindex_q"] = np.zeros((Tq, Hi, D))
            grads["dindex_k"] = np.zeros((Tk, 1, D))
            grad_scale = settings.kl_grad_scale if settings.kl_grad_scale else 1.0 / (Hi * total_q)
    for doc in docs:
        if doc.q_len == 0:
            continue
        keys = slice(doc.k_start, doc.k_start + doc.k_len)
        positions = doc.positions()
        s_index = index_scores(doc, index_q, index_k, settings) if want_backward and with_kl else None
        # Rows in chunks so that [chunk, G, keys] stays small.
        chunk = max(1, (1 << 22) // max(1, G * doc.k_len))
        for r0 in range(0, doc.q_len, chunk):
            r1 = min(doc.q_len, r0 + chunk)
            rows = slice(doc.q_start + r0, doc.q_start + r1)
            kl = int(positions[r1 - 1]) + 1  # keys beyond the chunk's last position are masked anyway
            for g in range(Hkv):
                heads = slice(g * G, (g + 1) * G)
                mask = selected_keys_mask(positions[r0:r1], kl, topk[g, rows])  # [c, kl]
                Kg = k[keys, g][:kl]  # [kl, D]
                Vg = v[keys, g][:kl]
                Q = q[rows, heads]  # [c, G, D]
                c = Q.shape[0]
                Qf = Q.reshape(c * G, D)
                z = (Qf @ Kg.T).reshape(c, G, kl) * scale
                z = np.where(mask[:, None, :], z, -np.inf)
                row_lse = logsumexp(z, axis=2)  # [c, G]
                finite = np.isfinite(row_lse)
                P = np.where(mask[:, None, :], np.exp(z - np.where(finite, row_lse, 0.0)[..., None]), 0.0)
                Pf = P.reshape(c * G, kl)
                O = (Pf @ Vg).reshape(c, G, D)
                out[rows, heads] = O
                lse[rows, heads] = row_lse
                if not want_backward:
                    continue
                dO = dout[rows, heads]
                dOf = dO.reshape(c * G, D)
                dP = (dOf @ Vg.T).reshape(c, G, kl)
                delta = np.sum(dO * (O if given_out is None else given_out[rows, heads]), axis=2)
                dS = P * (dP - delta[..., None])
                dSf = dS.reshape(c * G, kl)
                grads["dq"][rows, heads] = (dSf @ Kg).reshape(c, G, D) * scale
                grads["dk"][doc.k_start : doc.k_start + kl, g] += (dSf.T @ Qf) * scale
                grads["dv"][doc.k_start : doc.k_start + kl, g] += Pf.T @ dOf
                if not with_kl:
                    continue
                # KL: teacher = mean over the group's heads of P; student = softmax of the index
                # scores over the same keys.
                teacher = P.mean(axis=1)  # [c, kl]
                s = np.where(mask, s_index[g, r0:r1, :kl], -np.inf)
                s_lse = logsumexp(s, axis=1)
                student = np.where(mask, np.exp(s - np.where(np.isfinite(s_lse), s_lse, 0.0)[:, None]), 0.0)
                ds = (student - teacher) * grad_scale
                qi = index_q[rows, g]  # [c, D]
                ki = index_k[keys, 0][:kl]
                grads["dindex_q"][rows, g] = ds @ ki * settings.index_scale
                grads["dindex_k"][doc.k_start : doc.k_start + kl, 0] += ds.T @ qi * settings.index_scale
    return out, lse, grads


# ------------------------------------------------------------------------------------------
# Merge of partial states (docs/semantics.md §8) and error measures (§10)


def merge_states(out_partials, lse_partials):
    """out [rows, H, D], lse [rows, H] of partials [S, rows, H, D] / [S, rows, H]: weights
    exp(lse_s - max lse); a row whose partials are all -inf gives out 0, lse -inf."""
    m = lse_partials.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.where(np.isfinite(lse_partials), np.exp(lse_partials - m_safe), 0.0)
    z = w.sum(axis=0)
    out = np.where(z[..., None] > 0, (w[..., None] * out_partials).sum(0) / np.where(z > 0, z, 1)[..., None], 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(z > 0, np.log(np.where(z > 0, z, 1)) + m_safe, -np.inf)
    return out, lse


def rel_err(a, b):
    """Relative L2 error of a against the reference b."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
