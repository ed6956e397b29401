"""Inference bindings: a paged prefill over an identity page table equals the training path."""

import numpy as np
import pytest

import msa
import msa.inference as inf
import numpy_reference as ref
from conftest import bf16_input


def test_paged_prefill_matches_training_forward(rng):
    t, hkv = 400, 1
    topo = msa.Topology(num_q_heads=16, num_kv_heads=hkv, num_index_heads=hkv)
    q, k, v = bf16_input(rng, t, 16, 128)[0], bf16_input(rng, t, hkv, 128)[0], bf16_input(rng, t, hkv, 128)[0]
    iq, ik = bf16_input(rng, t, hkv, 128)[0], bf16_input(rng, t, 1, 128)[0]
    pages = (t + 127) // 128
    # Scattered physical pages: logical page j lives in physical page perm[j].
    perm = np.array([2, 0, 3, 1], np.int32)[:pages]
    k_cache = np.zeros((4, hkv, 128, 128), np.uint16)
    v_cache = np.zeros_like(k_cache)
    index_k_cache = np.zeros((4, 128, 128), np.uint16)
    plan = inf.plan_paged_prefill([0, t], [t], perm[None, :], topo)
    slots = plan.arrays()["slot_mapping"]
    np.testing.assert_array_equal(slots, perm[np.arange(t) // 128] * 128 + np.arange(t) % 128)
    inf.insert_kv(k, v, slots, k_cache, v_cache, index_k=ik, index_k_cache=index_k_cache)
    topk, out, lse = inf.paged_forward(plan, q, iq, k_cache, v_cache, index_k_cache)

    layout = msa.make_layout([0, t])
    want_topk = msa.select_blocks(iq, ik, layout, topo)
    np.testing.assert_array_equal(np.sort(topk, -1), np.sort(want_topk, -1))
    want_out, want_lse = msa.forward(q, k, v, want_topk, layout, topology=topo)
    assert ref.rel_err(out, want_out) < 1e-5
    np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_decode_plan_and_norm_rope():
    plan = inf.plan_decode([130, 0], np.array([[0, 1], [0, 0]], np.int32), q_len_per_req=2,
                           topology=msa.Topology(num_q_heads=16, num_kv_heads=1, num_index_heads=1))
    assert plan.total_q == 4
    assert plan.arrays()["positions"].tolist()[:2] == [128, 129]
    # The plan's stream (CUDA: where its uploads are queued) is an integer cudaStream_t.
    assert inf.plan_decode([130], np.array([[0, 1]], np.int32), stream=0).total_q == 1
    with pytest.raises(msa.InvalidArgumentError, match="stream must be an integer"):
        inf.plan_paged_prefill([0, 2], [130], np.array([[0, 1]], np.int32), stream="fast")
    x = msa.bf16.from_float(np.ones((3, 1, 128)))
    y = inf.rms_norm_rope(x, np.zeros(128, np.float32), np.zeros(3, np.int32))
    np.testing.assert_allclose(msa.bf16.to_float(y), 1.0, rtol=1e-2)


def test_update_decode_plan_runs_the_next_step(rng):
    # An engine's decode loop: the plan of one step rewritten for the next gives what a new plan
    # of the next step gives, bit for bit on the CPU.
    topo = msa.Topology(num_q_heads=16, num_kv_heads=1, num_index_heads=1)
    pages, q_len = 24, 2
    k_cache, v_cache = bf16_input(rng, pages, 1, 128, 128)[0], bf16_input(rng, pages, 1, 128, 128)[0]
    index_k_cache = bf16_input(rng, pages, 128, 128)[0]
    table = rng.permutation(pages).astype(np.int32).reshape(2, 12)
    q, iq = bf16_input(rng, 2 * q_len, 16, 128)[0], bf16_input(rng, 2 * q_len, 1, 128)[0]
    plan = inf.plan_decode([1500, 700], table, q_len, topo)
    next_table = table[::-1].copy()
    inf.update_decode_plan(plan, [1400, 2], next_table)
    assert plan.arrays()["seq_lens"].tolist() == [1400, 2]
    got = inf.paged_forward(plan, q, iq, k_cache, v_cache, index_k_cache)
    want = inf.paged_forward(inf.plan_decode([1400, 2], next_table, q_len, topo), q, iq, k_cache, v_cache,
                             index_k_cache)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(msa.InvalidArgumentError, match="longer than the plan's max_seqlen_k = 1500"):
        inf.update_decode_plan(plan, [1501, 2], next_table)
    with pytest.raises(msa.InvalidArgumentError, match="batch = 2 entries, got 1"):
        inf.update_decode_plan(plan, [700], next_table[:1])
