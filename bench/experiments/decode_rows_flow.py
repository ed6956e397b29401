# Host model of paged_decode_rows.cu's per-row flow in float64: W warps take turns over the row's
# selected pages (online softmax in log2 units, per-token K / V scales with the running largest
# V scale R), scale back by R, combine, normalise; against softmax attention over the union.
# Run: python bench/experiments/decode_rows_flow.py
import numpy as np
rng = np.random.default_rng(3)
L2E = 1.0 / np.log(2.0)
def run(W, pages, limits, per_token):
    H, D = 16, 128
    q = rng.standard_normal((H, D)); scale = 0.088
    K = [rng.standard_normal((128, D)) for _ in pages]; V = [rng.standard_normal((128, D)) for _ in pages]
    ks = [rng.uniform(0.01, 3.0, 128) if per_token else np.ones(128) for _ in pages]
    vs = [rng.uniform(0.001, 50.0, 128) if per_token else np.ones(128) for _ in pages]
    # reference
    logits = []; vals = []
    for u in range(len(pages)):
        n = limits[u]
        logits.append((q @ K[u][:n].T) * ks[u][:n] * scale); vals.append(V[u][:n] * vs[u][:n, None])
    Lg = np.concatenate(logits, 1); Vv = np.concatenate(vals, 0)
    P = np.exp(Lg - Lg.max(1, keepdims=True)); ref = (P @ Vv) / P.sum(1, keepdims=True)
    ref_lse = np.log(P.sum(1)) + Lg.max(1)
    # kernel model
    states = []
    for turn in range(W):
        o = np.zeros((H, D)); m = np.full(H, -np.inf); l = np.zeros(H); R = 0.0
        for i, u in enumerate(range(len(pages))):
            if i % W != turn: continue
            n = limits[u]
            s = (q @ K[u].T) * scale * L2E * ks[u]
            s[:, n:] = -np.inf
            vmax = vs[u][:n].max() if per_token else 1.0
            run_ = max(R, vmax) if per_token else 1.0
            ratio = (R / run_ if run_ > 0 else 0.0) if per_token else 1.0
            inv = 1.0 / run_ if per_token else 1.0
            R = run_
            mnew = np.maximum(m, s.max(1)); use = np.where(mnew == -np.inf, 0, mnew)
            alpha = np.exp2(m - use); m = mnew; l = l * alpha; o = o * (alpha * ratio)[:, None]
            p = np.exp2(s - use[:, None]); l = l + p.sum(1)
            w = np.where(np.arange(128) < n, vs[u] * inv, 0.0)
            o = o + (p * w) @ V[u]
        if per_token: o = o * R
        states.append((o, m, l))
    o, m, l = states[0]
    for o2, m2, l2 in states[1:]:
        mnew = np.maximum(m, m2); use = np.where(mnew == -np.inf, 0, mnew)
        a1 = np.exp2(m - use); a2 = np.exp2(m2 - use)
        o = o * a1[:, None] + o2 * a2[:, None]; l = l * a1 + l2 * a2; m = mnew
    out = o / l[:, None]; lse = (m + np.log2(l)) / L2E
    return np.abs(out - ref).max() / np.abs(ref).max(), np.abs(lse - ref_lse).max()
for W in (1, 2, 4, 8):
    for per_token in (False, True):
        for npages in (1, 3, 16):
            limits = [128] * (npages - 1) + [77]
            e, el = run(W, list(range(npages)), limits, per_token)
            assert e < 1e-12 and el < 1e-9, (W, per_token, npages, e, el)
print("flow model matches the reference for W = 1, 2, 4, 8, with and without per-token scales")
