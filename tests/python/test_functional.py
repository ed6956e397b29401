"""Functional ops on NumPy arrays against the float64 oracle (numpy_reference.py)."""

import numpy as np
import pytest

import msa
import numpy_reference as ref
from conftest import bf16_input

# Three documents, one shorter than a block, one over several blocks with a partial last block.
CU = [0, 70, 400, 655]


def make_inputs(rng, cu=CU, hkv=1):
    layout = msa.make_layout(cu)
    t = cu[-1]
    x = {name: bf16_input(rng, *shape) for name, shape in
         dict(q=(t, 16 * hkv, 128), k=(t, hkv, 128), v=(t, hkv, 128), iq=(t, hkv, 128), ik=(t, 1, 128)).items()}
    return layout, x


def check_selection(topk, layout, iq, ik, tol=1e-4):
    """Contract (prefix, unique, local last, count) and the threshold rule of docs/semantics.md §10."""
    want, scores = ref.select_blocks(iq, ik, layout)
    got = ref.topk_to_sets(topk)
    for g in range(topk.shape[0]):
        for row in range(topk.shape[1]):
            row_ids = topk[g, row]
            n = len(got[g][row])
            assert (row_ids[n:] == -1).all(), f"valid ids must form a prefix: {row_ids}"
            assert len(set(got[g][row])) == n, f"duplicate ids: {row_ids}"
            assert n == len(want[g][row]), (g, row, got[g][row], want[g][row])
            assert got[g][row][-1] == want[g][row][-1], "local block must be last"
            if set(got[g][row]) != set(want[g][row]):
                s = scores[g][row]
                threshold = min(s[b] for b in want[g][row][:-1])
                for b in set(got[g][row]) - set(want[g][row]):
                    assert s[b] >= threshold - tol, (g, row, b, s[b], threshold)


def test_select_blocks_short_documents(rng):
    layout, x = make_inputs(rng)
    topk, lse = msa.select_blocks(x["iq"][0], x["ik"][0], layout, return_lse=True)
    assert topk.shape == (1, layout.total_q, 16) and topk.dtype == np.int32
    check_selection(topk, layout, x["iq"][1], x["ik"][1])
    want_lse = ref.selected_lse(x["iq"][1], x["ik"][1], topk, layout)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-4)


def test_select_blocks_ranks_history_beyond_16_blocks(rng):
    # One document of 18+ blocks (2 index heads) so that the top-15 ranking is exercised.
    cu = [0, 2350]
    layout = msa.make_layout(cu)
    iq = bf16_input(rng, 2350, 2, 128)
    ik = bf16_input(rng, 2350, 1, 128)
    topk = msa.select_blocks(iq[0], ik[0], layout)
    assert (topk[:, -1] >= 0).sum() == 2 * 16  # the last query selects 16 blocks per head
    check_selection(topk, layout, iq[1], ik[1])


def test_select_blocks_ties_prefer_lower_ids():
    layout = msa.make_layout([0, 2304])
    zeros = np.zeros((2304, 1, 128), np.uint16)
    topk = msa.select_blocks(zeros, zeros, layout)
    assert topk[0, 2303].tolist() == list(range(15)) + [17]


def test_forward_matches_oracle(rng):
    layout, x = make_inputs(rng)
    topk = msa.select_blocks(x["iq"][0], x["ik"][0], layout)
    plan = msa.build_plan(topk, layout)
    out, lse = msa.forward(x["q"][0], x["k"][0], x["v"][0], topk, layout, plan)
    want_out, want_lse, _ = ref.attention(x["q"][1], x["k"][1], x["v"][1], topk, layout)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert ref.rel_err(out, want_out) < 1e-4
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    out_bf16, _ = msa.forward(x["q"][0], x["k"][0], x["v"][0], topk, layout, plan, out_dtype="bfloat16")
    assert out_bf16.dtype == np.uint16
    assert ref.rel_err(msa.bf16.to_float(out_bf16), want_out) < 1e-2


def test_backward_matches_oracle(rng):
    layout, x = make_inputs(rng)
    topk = msa.select_blocks(x["iq"][0], x["ik"][0], layout)
    out, lse = msa.forward(x["q"][0], x["k"][0], x["v"][0], topk, layout)
    dout = rng.normal(size=out.shape).astype(np.float32)
    dq, dk, dv = msa.backward(dout, x["q"][0], x["k"][0], x["v"][0], topk, out, lse, layout)
    want = ref.attention_backward(dout.astype(np.float64), x["q"][1], x["k"][1], x["v"][1], topk,
                                  out.astype(np.float64), layout)
    for name, got, exp in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert ref.rel_err(got, exp) < 1e-4, name
        assert ref.cosine(got, exp) > 0.9999, name


def test_kl_backward_matches_oracle(rng):
    layout, x = make_inputs(rng)
    topk, index_lse, plan = msa.prepare(x["iq"][0], x["ik"][0], layout)
    _, lse = msa.forward(x["q"][0], x["k"][0], x["v"][0], topk, layout, plan)
    diq, dik = msa.kl_backward(x["q"][0], x["k"][0], lse, x["iq"][0], x["ik"][0], index_lse, topk, layout, plan)
    want_q, want_k = ref.kl_backward(x["q"][1], x["k"][1], x["iq"][1], x["ik"][1], topk, layout)
    np.testing.assert_allclose(diq, want_q, rtol=1e-2, atol=2e-3 * np.abs(want_q).max())
    np.testing.assert_allclose(dik, want_k, rtol=1e-2, atol=2e-3 * np.abs(want_k).max())
    assert ref.cosine(diq, want_q) > 0.999 and ref.cosine(dik, want_k) > 0.999


def test_merge_states_matches_oracle(rng):
    out_p = rng.normal(size=(3, 10, 4, 128)).astype(np.float32)
    lse_p = rng.normal(size=(3, 10, 4)).astype(np.float32)
    lse_p[:, 0, 0] = -np.inf  # an empty row gives out 0, lse -inf
    out, lse = msa.merge_states(out_p, lse_p)
    want_out, want_lse = ref.merge_states(out_p.astype(np.float64), lse_p.astype(np.float64))
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert lse[0, 0] == -np.inf and (out[0, 0] == 0).all()


def test_pack_unpack_roundtrip(rng):
    doc = np.array([[1, 1, 1, 0, 0], [2, 2, 3, 3, 3]], np.int32)
    layout = msa.make_layout(document_map=doc)
    assert layout.num_documents == 3 and layout.total_q == 8
    assert layout.query_positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    x = rng.normal(size=(2, 5, 3)).astype(np.float32)
    packed = msa.pack(x, layout)
    np.testing.assert_array_equal(packed, x[doc != 0])
    back = msa.unpack(packed, layout)
    np.testing.assert_array_equal(back, np.where((doc != 0)[..., None], x, 0))


def test_ml_dtypes_bfloat16_inputs(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    layout, x = make_inputs(rng, cu=[0, 200])
    as_bf16 = {k: v[0].view(ml_dtypes.bfloat16) for k, v in x.items()}
    topk = msa.select_blocks(as_bf16["iq"], as_bf16["ik"], layout)
    out, _ = msa.forward(as_bf16["q"], as_bf16["k"], as_bf16["v"], topk, layout, out_dtype="bfloat16")
    assert out.dtype == ml_dtypes.bfloat16
    want, _ = msa.forward(x["q"][0], x["k"][0], x["v"][0], topk, layout, out_dtype="bfloat16")
    np.testing.assert_array_equal(out.view(np.uint16), want)


def test_outputs_are_deterministic(rng):
    layout, x = make_inputs(rng)
    runs = []
    for _ in range(2):
        topk, lse_i, plan = msa.prepare(x["iq"][0], x["ik"][0], layout, deterministic=True)
        out, lse = msa.forward(x["q"][0], x["k"][0], x["v"][0], topk, layout, plan, deterministic=True)
        grads = msa.backward(out, x["q"][0], x["k"][0], x["v"][0], topk, out, lse, layout, plan, deterministic=True)
        runs.append([topk, lse_i, out, lse, *grads])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


def test_plan_arrays_share_memory(rng):
    layout, x = make_inputs(rng)
    topk = msa.select_blocks(x["iq"][0], x["ik"][0], layout)
    plan = msa.build_plan(topk, layout)
    arrays = plan.arrays()
    assert arrays["row_ptr"].shape == (1, layout.total_rows() + 1)
    assert arrays["split_counts"].shape == (layout.total_q, 1)
    # every valid (query, block) edge appears once in the CSR
    assert int(arrays["row_ptr"][0, -1]) == int((topk >= 0).sum())
    del plan
    assert arrays["q_indices"].shape[1] == layout.total_q * 16  # still alive through the array
