#!/usr/bin/env python3
"""Independent check of `msa run-case` against the float64 NumPy oracle (oracle_np.py,
inference_np.py) written from docs/semantics.md.

Generates the cases of make_cases.py, runs `msa run-case` on each and compares:
  * selection: the output contract (valid prefix, unique ids, count = min(16, visible blocks),
    the query's own block last) and the sets against the oracle's, where a different set is
    accepted only at near-ties (every block msa ranked scores within 5e-3 of the oracle's
    weakest ranked block); the ties case must match exactly;
  * with msa's own selection (docs/semantics.md §10): out (atol = rtol = 3e-2, and relative L2 <= 1e-2),
    LSE (1e-3), indexer LSE (2e-3), dq / dk / dv and dindex_q / dindex_k (cosine > 0.99);
    out and every gradient also row by row (relative L2 of each row <= 2e-2), which catches
    a few wrong rows that whole-tensor measures average away;
  * inference cases (`mode` decode / paged_prefill over bf16, fp8 and nvfp4 paged caches,
    oracle in inference_np.py): the same selection rules on the unscaled page scores (near-tie
    slack 5e-3 x max(1, largest |score| of the row)), then out and LSE over msa's selection;
    rows without keys (seq_len 0) must give all -1, out 0 and LSE -inf.
With --compare-with BACKEND every case also runs on that backend and the two result files are
compared directly: integer outputs (the selection) element by element, float outputs by relative
L2 (out <= 2e-2, gradients <= 5e-2: twice what each backend may differ from the oracle) and LSEs
by largest difference (4e-3), with infinities in the same places. Where the selections differ
(allowed only at near-ties, which the oracle check of each backend vouches for) the float
outputs are reported, not judged.
Prints one row per case and exits 1 if any case fails; exits 77 (skipped) without NumPy.

    python3 check_cases.py --msa build/tools/msa/msa [--work DIR] [--backend cpu|cuda|auto]
                           [--compare-with cpu|cuda]
"""

import argparse
import os
import re
import subprocess
import sys
import time

try:
    import numpy as np
except ImportError:
    print("SKIP: NumPy is not installed (pip install numpy); the independent run-case check did not run")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_cases  # noqa: E402
import inference_np as inference  # noqa: E402
import oracle_np as oracle  # noqa: E402
import safetensors_np as st  # noqa: E402

OUT_TOL, LSE_TOL, INDEX_LSE_TOL, MIN_COSINE, NEAR_TIE, MAX_OUT_REL_L2 = 3e-2, 1e-3, 2e-3, 0.99, 5e-3, 1e-2
# Per-row relative error allowed for out and gradients (bf16 rounding gives ~2e-3 per row).
MAX_ROW_ERROR = 2e-2
# Cross-backend limits (--compare-with): each backend is within half of these of the oracle.
CROSS_OUT_REL_L2, CROSS_GRAD_REL_L2, CROSS_LSE_DIFF = 2e-2, 5e-2, 4e-3


def rel_l2(x, ref):
    den = np.linalg.norm(ref)
    num = np.linalg.norm(x - ref)
    return 0.0 if num == 0 else (num / den if den > 0 else np.inf)


def cosine(x, ref):
    x, ref = x.ravel(), ref.ravel()
    nx, nr = np.linalg.norm(x), np.linalg.norm(ref)
    if nx == 0 and nr == 0:
        return 1.0
    if nx == 0 or nr == 0 or not np.isfinite(nx):
        return 0.0
    return float(np.dot(x, ref) / (nx * nr))


def worst_row_error(x, ref):
    """Largest per-row relative L2 error, rows = all but the last axis. A row's error is
    ||x_r - ref_r|| / max(||ref_r||, 0.1 * rms row norm) so that rows whose reference is
    (nearly) zero are judged against the typical row size. Global measures (cosine, relative
    L2 of the whole tensor) cannot see a few wrong rows among thousands; this does."""
    x = x.reshape(-1, x.shape[-1])
    ref = ref.reshape(-1, ref.shape[-1])
    ref_norm = np.linalg.norm(ref, axis=1)
    finite = np.isfinite(ref_norm)
    floor = 0.1 * np.sqrt(np.mean(ref_norm[finite] ** 2)) if finite.any() else 0.0
    with np.errstate(invalid="ignore"):
        err = np.linalg.norm(np.where(np.isfinite(ref), x - ref, 0.0), axis=1) / np.maximum(ref_norm, max(floor, 1e-30))
    err[~np.isfinite(np.linalg.norm(x, axis=1))] = np.inf
    return float(np.max(err, initial=0.0))


def allclose_violations(x, ref, tol):
    """Elements outside |x - ref| <= tol + tol |ref|; equal infinities match, NaN never does."""
    both_inf = np.isinf(x) & np.isinf(ref) & (np.sign(x) == np.sign(ref))
    with np.errstate(invalid="ignore"):
        ok = both_inf | (np.abs(x - ref) <= tol + tol * np.abs(ref))
    return int(np.size(ok) - np.count_nonzero(ok))


def as_f64(t):
    if t.dtype == "BF16":
        return st.bf16_bits_to_f64(t.array)
    return t.array.astype(np.float64)


def settings_from(meta):
    def num(key, default=None):
        return float(meta[key]) if key in meta else default

    return oracle.Settings(init_blocks=int(meta.get("init_blocks", 0)), local_blocks=int(meta.get("local_blocks", 1)),
                           softmax_scale=num("softmax_scale"), index_scale=num("index_scale"),
                           lse_temperature=num("lse_temperature", 1.0), kl_grad_scale=num("kl_grad_scale"))


def output_shape_problems(outputs, expected):
    """One message per output of `expected` ({name: (dtype, shape)}) that is missing or differs."""
    problems = []
    for name, (dtype, shape) in expected.items():
        t = outputs.get(name)
        if t is None or t.dtype != dtype or t.array.shape != tuple(shape):
            got = "missing" if t is None else f"{t.dtype} {list(t.array.shape)}"
            problems.append(f"output {name} must be {dtype} {list(shape)}, got {got}")
    return problems


def check_selection(docs, index_q, index_k, topk, settings, exact):
    """Returns (rows checked, near-ties, first problem or None)."""
    hi = topk.shape[0]
    rows = near = 0
    for doc in docs:
        if doc.q_len == 0:
            continue
        blocks = oracle.block_scores(oracle.index_scores(doc, index_q, index_k, settings), doc.k_len)
        for i, p in enumerate(doc.positions()):
            p = int(p)
            for g in range(hi):
                row = topk[g, doc.q_start + i]
                where = f"topk[{g}, {doc.q_start + i}] (position {p})"
                valid = [int(b) for b in row if b >= 0]
                nvis = p // 128 + 1
                if list(row[len(valid):]) != [-1] * (16 - len(valid)):
                    return rows, near, f"{where}: valid ids must be a prefix followed by -1, got {list(row)}"
                if len(set(valid)) != len(valid) or any(b >= nvis for b in valid):
                    return rows, near, f"{where}: repeated or invisible block in {valid}"
                if len(valid) != min(16, nvis) or valid[-1] != p // 128:
                    return rows, near, f"{where}: expected {min(16, nvis)} ids ending with the local block {p // 128}, got {valid}"
                want, forced, ranked, _ = oracle.select_row(blocks[g, i], p, settings)
                rows += 1
                if set(valid) == want:
                    continue
                problem = f"{where}: msa selected {sorted(valid)}, the oracle {sorted(want)}"
                if exact or not ranked or not forced <= set(valid):
                    return rows, near, problem
                threshold = min(blocks[g, i, b] for b in ranked)
                if any(blocks[g, i, b] < threshold - NEAR_TIE for b in set(valid) - forced):
                    return rows, near, problem
                near += 1
    return rows, near, None


def run_msa(case, msa, backend, threads, suffix):
    """Runs `msa run-case` on the case; returns (process, output path, seconds)."""
    out_path = case.path.replace(".safetensors", f".{suffix}.safetensors")
    if os.path.exists(out_path):
        os.remove(out_path)
    cmd = [msa, "run-case", "--in", case.path, "--out", out_path, "--backend", backend]
    if threads:
        cmd += ["--threads", str(threads)]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc, out_path, time.time() - start


def compare_backends(mine, other, other_backend):
    """Direct comparison of two run-case result files of one case. Returns (summary, problems)."""
    problems = []
    if sorted(mine) != sorted(other):
        return "outputs differ", [f"outputs {sorted(mine)} vs {other_backend}'s {sorted(other)}"]
    differing_ints = 0
    for name, t in mine.items():
        if t.dtype != other[name].dtype or t.array.shape != other[name].array.shape:
            problems.append(f"{name}: {t.dtype} {list(t.array.shape)} vs {other_backend}'s "
                            f"{other[name].dtype} {list(other[name].array.shape)}")
        elif t.dtype.startswith("I"):
            differing_ints += int(np.count_nonzero(t.array != other[name].array))
    if problems:
        return "outputs differ", problems
    worst_l2, worst_lse = 0.0, 0.0
    for name, t in sorted(mine.items()):
        if t.dtype.startswith("I"):
            continue
        x, ref = as_f64(t), as_f64(other[name])
        if not np.array_equal(np.isfinite(x), np.isfinite(ref)) or not np.array_equal(x[np.isinf(x)], ref[np.isinf(ref)]):
            problems.append(f"{name}: non-finite values in other places than on {other_backend}")
            continue
        finite = np.isfinite(ref)
        if name.endswith("lse"):
            diff = float(np.max(np.abs(x[finite] - ref[finite]), initial=0.0))
            worst_lse = max(worst_lse, diff)
            if differing_ints == 0 and diff > CROSS_LSE_DIFF:
                problems.append(f"{name}: largest difference {diff:.2e} from {other_backend} (<= {CROSS_LSE_DIFF})")
        else:
            err = rel_l2(x[finite], ref[finite])
            worst_l2 = max(worst_l2, err)
            limit = CROSS_OUT_REL_L2 if name == "out" else CROSS_GRAD_REL_L2
            if differing_ints == 0 and not err <= limit:
                problems.append(f"{name}: relative L2 {err:.2e} from {other_backend} (<= {limit})")
    selection = "same ids" if differing_ints == 0 else f"{differing_ints} ids differ"
    return f"{selection}, L2 {worst_l2:.1e}, lse {worst_lse:.1e}", problems


def run_case(case, msa, backend, threads, compare_with=""):
    row = check_case(case, msa, backend, threads)
    if not compare_with or case.expect_error or row["result"] != "ok":
        return row
    proc, other_path, _ = run_msa(case, msa, compare_with, threads, compare_with)
    if proc.returncode != 0:
        return {**row, "result": "FAIL", "vs " + compare_with: "failed",
                "details": f"msa run-case --backend {compare_with} exited with {proc.returncode}: {proc.stderr.strip()}"}
    summary, problems = compare_backends(st.read(row["output"])[0], st.read(other_path)[0], compare_with)
    row["vs " + compare_with] = summary
    if problems:
        row["result"], row["details"] = "FAIL", "; ".join(problems)
    return row


def check_case(case, msa, backend, threads):
    proc, out_path, seconds = run_msa(case, msa, backend, threads, "out")
    row = {"case": case.name, "msa": f"{seconds:.1f} s", "output": out_path}

    if case.expect_error:
        ok = proc.returncode == 2 and re.search(case.expect_error, proc.stderr) and not os.path.exists(out_path)
        row["result"] = "ok" if ok else "FAIL"
        row["details"] = f"rejected: {proc.stderr.strip()}" if ok else (
            f"expected exit 2 and /{case.expect_error}/, got exit {proc.returncode}: {proc.stderr.strip()}")
        return row
    if proc.returncode != 0:
        row["result"] = "FAIL"
        row["details"] = f"msa run-case exited with {proc.returncode}: {proc.stderr.strip()}"
        return row

    inputs, meta = st.read(case.path)
    outputs, _ = st.read(out_path)
    if meta.get("mode") in ("decode", "paged_prefill"):
        return check_inference_case(row, inputs, meta, outputs)
    settings = settings_from(meta)
    q, k, v = as_f64(inputs["q"]), as_f64(inputs["k"]), as_f64(inputs["v"])
    index_q, index_k = index_values(inputs["index_q"]), index_values(inputs["index_k"])
    cu_q, cu_k = inputs["cu_seqlens_q"].array, inputs["cu_seqlens_k"].array
    fragments = inputs["fragment_indices"].array if "fragment_indices" in inputs else None
    docs = oracle.documents(cu_q, cu_k, fragments)
    total_q, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
    has_grad = "grad_out" in inputs
    row["shape"] = f"{total_q} tok, {hq}/{hkv} heads"

    problems = []
    expected = {"topk": ("I32", (hkv, total_q, 16)), "out": ("BF16", (total_q, hq, 128)), "lse": ("F32", (total_q, hq)),
                "indexer_lse": ("F32", (hkv, total_q))}
    if has_grad:
        for name, shape in {"dq": q.shape, "dk": k.shape, "dv": k.shape, "dindex_q": index_q.shape,
                            "dindex_k": index_k.shape}.items():
            expected[name] = ("F32", shape)
    problems += output_shape_problems(outputs, expected)
    if problems:
        row["result"], row["details"] = "FAIL", "; ".join(problems)
        return row

    topk = outputs["topk"].array.astype(np.int64)
    if case.given_topk:
        same = np.array_equal(topk, inputs["topk"].array)
        row["selection"] = "given" if same else "CHANGED"
        if not same:
            problems.append("the output topk differs from the given one")
    else:
        rows, near, problem = check_selection(docs, index_q, index_k, topk, settings, case.exact_selection)
        row["selection"] = f"{rows} rows" + (f", {near} near-ties" if near else "")
        if problem:
            row["selection"] = "WRONG"
            problems.append(problem)
            return {**row, "result": "FAIL", "details": "; ".join(problems)}

    # Indexer LSE over msa's selection at the file's temperature.
    ref_index_lse = np.full((hkv, total_q), -np.inf)
    for doc in docs:
        ref_index_lse[:, doc.q_start:doc.q_start + doc.q_len] = oracle.selected_lse(
            doc, index_q, index_k, topk, settings, settings.lse_temperature)
    index_lse = outputs["indexer_lse"].array.astype(np.float64)
    bad = allclose_violations(index_lse, ref_index_lse, INDEX_LSE_TOL)
    finite = np.isfinite(ref_index_lse)
    row["idx lse err"] = f"{np.max(np.abs(index_lse[finite] - ref_index_lse[finite]), initial=0):.1e}"
    if bad:
        problems.append(f"indexer_lse: {bad} values outside {INDEX_LSE_TOL}")

    dout = as_f64(inputs["grad_out"]) if has_grad else None
    out = as_f64(outputs["out"])
    ref_out, ref_lse, ref_grads = oracle.attention_and_kl(docs, q, k, v, index_q, index_k, topk, dout, settings, total_q,
                                                          has_grad, given_out=out)
    lse = outputs["lse"].array.astype(np.float64)
    row["out rel L2"] = f"{rel_l2(out, ref_out):.1e}"
    finite = np.isfinite(ref_lse)
    row["lse err"] = f"{np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0):.1e}"
    bad_out, bad_lse = allclose_violations(out, ref_out, OUT_TOL), allclose_violations(lse, ref_lse, LSE_TOL)
    row_errors = [worst_row_error(out, ref_out)]
    if bad_out or not rel_l2(out, ref_out) <= MAX_OUT_REL_L2 or not row_errors[0] <= MAX_ROW_ERROR:
        problems.append(f"out: {bad_out} values outside {OUT_TOL}, rel L2 {rel_l2(out, ref_out):.2e}, "
                        f"worst row error {row_errors[0]:.2e}")
    if bad_lse:
        problems.append(f"lse: {bad_lse} values outside {LSE_TOL}")
    if has_grad:
        cosines = []
        for name in ("dq", "dk", "dv", "dindex_q", "dindex_k"):
            mine = outputs[name].array.astype(np.float64)
            c, worst = cosine(mine, ref_grads[name]), worst_row_error(mine, ref_grads[name])
            cosines.append(c)
            row_errors.append(worst)
            if not (c > MIN_COSINE and worst <= MAX_ROW_ERROR):
                problems.append(f"{name}: cosine {c:.5f} (> {MIN_COSINE} needed), worst row error {worst:.2e} "
                                f"(<= {MAX_ROW_ERROR} needed), rel L2 {rel_l2(mine, ref_grads[name]):.2e}")
        row["grad cos (min)"] = f"{min(cosines):.6f}"
    else:
        row["grad cos (min)"] = "-"
    row["worst row"] = f"{max(row_errors):.1e}"
    row["result"] = "FAIL" if problems else "ok"
    row["details"] = "; ".join(problems)
    return row


def dequantised_caches(inputs, kv_format):
    """(K, V) float64 [physical pages, Hkv, 128, 128] from the file's cache tensors."""
    caches = []
    for name in ("k", "v"):
        cache = inputs[f"{name}_cache"]
        scale = inputs[f"{name}_scale"].array.astype(np.float64) if f"{name}_scale" in inputs else None
        if kv_format == "bf16":
            caches.append(as_f64(cache))
        elif kv_format == "fp8":
            x = inference.e4m3_decode(cache.array)
            if scale is not None and scale.ndim == 2:  # [Hkv, max_kv_tokens], slot = page * 128 + offset
                pages, hkv = x.shape[0], x.shape[1]
                scale = scale[:, : pages * inference.PAGE].reshape(hkv, pages, inference.PAGE).transpose(1, 0, 2)[..., None]
            caches.append(x * (1.0 if scale is None else scale.reshape(-1)[0] if scale.ndim < 2 else scale))
        else:
            g = 1.0 if scale is None else float(scale.reshape(-1)[0])
            caches.append(inference.nvfp4_decode(cache.array, inputs[f"{name}_cache_sf"].array, g))
    return caches


def index_values(t):
    return inference.e4m3_decode(t.array) if t.dtype == "F8_E4M3" else as_f64(t)


def check_inference_case(row, inputs, meta, outputs):
    """Paged prefill / decode: selection against the oracle's (near-ties allowed), then out and
    LSE against the float64 oracle over msa's own selection; rows without keys must give
    all -1, 0 and -inf."""
    mode, kv_format = meta["mode"], meta.get("kv_format", "bf16")
    q, index_q = as_f64(inputs["q"]), index_values(inputs["index_q"])
    index_k = index_values(inputs["index_k_cache"])  # [phys, 128, D]
    table, seq_lens = inputs["page_table"].array.astype(np.int64), inputs["seq_lens"].array
    total_q, hq = q.shape[0], q.shape[1]
    hi = index_q.shape[1]
    k, v = dequantised_caches(inputs, kv_format)
    hkv = k.shape[1]
    cu = inputs["cu_seqlens_q"].array if "cu_seqlens_q" in inputs else None
    rows = inference.rows_of(mode, seq_lens, total_q, cu, int(meta.get("q_len_per_req", 0)))
    row["shape"] = f"{total_q} rows, {hq}/{hkv} heads, {kv_format}"

    problems = []
    expected = {"topk": ("I32", (hi, total_q, 16)), "out": ("BF16", (total_q, hq, 128)), "lse": ("F32", (total_q, hq))}
    problems += output_shape_problems(outputs, expected)
    if problems:
        return {**row, "result": "FAIL", "details": "; ".join(problems)}

    # Selection: contract, then sets with the near-tie rule on the fp32-accumulated page scores.
    topk = outputs["topk"].array.astype(np.int64)
    near = 0
    for r, (b, p) in enumerate(rows):
        local = p // inference.PAGE if p >= 0 else -1
        scores = inference.page_scores(index_q[r], index_k, table[b], max(local, 0))  # [Hi, local]
        for g in range(hi):
            ids = topk[g, r]
            valid = [int(x) for x in ids if x >= 0]
            where = f"topk[{g}, {r}] (request {b}, position {p})"
            want, ranked = inference.select(scores[g], p)
            problem = None
            if list(ids[len(valid):]) != [-1] * (16 - len(valid)):
                problem = f"{where}: valid ids must be a prefix followed by -1, got {list(ids)}"
            elif p < 0 and valid:
                problem = f"{where}: a row without keys must select nothing, got {valid}"
            elif p >= 0 and (len(valid) != min(16, local + 1) or valid[-1] != local or len(set(valid)) != len(valid)
                             or any(x > local for x in valid)):
                problem = f"{where}: expected {min(16, local + 1)} distinct visible ids ending with {local}, got {valid}"
            elif set(valid) != want:
                # A different set is accepted only at near-ties: every chosen history page must
                # score within NEAR_TIE (relative to the score size) of the oracle's 15th best.
                threshold = min((scores[g, x] for x in ranked), default=np.inf)
                slack = NEAR_TIE * max(1.0, float(np.max(np.abs(scores[g]))))
                if any(not scores[g, x] >= threshold - slack for x in set(valid) - {local}):
                    problem = f"{where}: msa selected {sorted(valid)}, the oracle {sorted(want)}"
                near += 1
            if problem:
                return {**row, "selection": "WRONG", "result": "FAIL", "details": problem}
    row["selection"] = f"{total_q * hi} rows" + (f", {near} near-ties" if near else "")

    # Attention over msa's selection; query head h reads KV head h // (Hq / Hkv).
    scale = float(meta["softmax_scale"]) if float(meta.get("softmax_scale", 0) or 0) > 0 else 1.0 / np.sqrt(128)
    group = hq // hkv
    ref_out, ref_lse = np.zeros((total_q, hq, 128)), np.full((total_q, hq), -np.inf)
    for r, (b, p) in enumerate(rows):
        for g in range(hkv):
            heads = slice(g * group, (g + 1) * group)
            pages = [int(x) for x in topk[g * hi // hkv, r] if x >= 0]
            ref_out[r, heads], ref_lse[r, heads] = inference.attention_row(
                q[r, heads], k[:, g], v[:, g], table[b], p, pages, scale)
    out, lse = as_f64(outputs["out"]), outputs["lse"].array.astype(np.float64)
    empty = np.array([p < 0 for _, p in rows])
    if empty.any() and (np.any(out[empty] != 0) or np.any(lse[empty] != -np.inf)):
        problems.append("rows without keys must give out 0 and lse -inf")
    row["out rel L2"] = f"{rel_l2(out, ref_out):.1e}"
    finite = np.isfinite(ref_lse)
    row["lse err"] = f"{np.max(np.abs(lse[finite] - ref_lse[finite]), initial=0):.1e}"
    bad_out, bad_lse = allclose_violations(out, ref_out, OUT_TOL), allclose_violations(lse, ref_lse, LSE_TOL)
    worst = worst_row_error(out, ref_out)
    row["worst row"] = f"{worst:.1e}"
    if bad_out or not rel_l2(out, ref_out) <= MAX_OUT_REL_L2 or not worst <= MAX_ROW_ERROR:
        problems.append(f"out: {bad_out} values outside {OUT_TOL}, rel L2 {rel_l2(out, ref_out):.2e}, "
                        f"worst row error {worst:.2e}")
    if bad_lse:
        problems.append(f"lse: {bad_lse} values outside {LSE_TOL}")
    row["result"] = "FAIL" if problems else "ok"
    row["details"] = "; ".join(problems)
    return row


def print_table(rows, compare_with=""):
    columns = ["case", "shape", "selection", "idx lse err", "out rel L2", "lse err", "grad cos (min)", "worst row", "msa"]
    columns += (["vs " + compare_with] if compare_with else []) + ["result"]
    width = {c: max(len(c), *(len(str(r.get(c, "-"))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(width[c]) for c in columns).rstrip())
    print("-" * (sum(width.values()) + 2 * (len(columns) - 1)))
    for r in rows:
        print("  ".join(str(r.get(c, "-")).ljust(width[c]) for c in columns).rstrip())
    for r in rows:
        if r.get("details"):
            print(f"  {r['case']}: {r['details']}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--msa", required=True, help="path to the msa executable")
    parser.add_argument("--work", default="independent_cases", help="folder for inputs and outputs")
    parser.add_argument("--backend", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--compare-with", default="", choices=["", "cpu", "cuda"],
                        help="also run every case on this backend and compare the two results directly")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()

    cases = make_cases.make_cases(args.work, args.seed)
    if args.cases:
        wanted = set(args.cases.split(","))
        unknown = wanted - {c.name for c in cases}
        if unknown:
            parser.error(f"unknown cases: {', '.join(sorted(unknown))}")
        cases = [c for c in cases if c.name in wanted]
    rows = []
    for case in cases:
        print(f"[check_cases] {case.name}: {case.description}", file=sys.stderr, flush=True)
        rows.append(run_case(case, args.msa, args.backend, args.threads, args.compare_with))
    print_table(rows, args.compare_with)
    failed = [r["case"] for r in rows if r["result"] != "ok"]
    agreement = f" and --backend {args.compare_with}" if args.compare_with else ""
    print(f"\n{'FAIL' if failed else 'PASS'}: {len(rows) - len(failed)}/{len(rows)} cases match the float64 NumPy oracle"
          + agreement + (f" (failed: {', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
