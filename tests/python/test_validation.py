"""What the Python layer converts, it checks: integer metadata must be integers (never
truncated), thread counts must be in range, empty batches give empty outputs, and KV scales
follow one rule in every cache format."""

import numpy as np
import pytest

import msa
import msa.inference as inf
from conftest import bf16_input

SMALL = msa.Topology(num_q_heads=16, num_kv_heads=1, num_index_heads=1)


# ---- integer metadata ----------------------------------------------------------------------

@pytest.mark.parametrize("cu", [np.array([0.0, 30.5]), np.array([0.0, 64.0], np.float32), [0, 30.5], [0, 64.0]])
def test_float_cu_seqlens_are_refused(cu):
    with pytest.raises(msa.InvalidArgumentError, match="cu_seqlens_q"):
        msa.make_layout(cu)
    with pytest.raises(msa.InvalidArgumentError, match="cu_seqlens_k"):
        msa.make_layout([0, 64], cu)


def test_float_fragment_indices_are_refused():
    with pytest.raises(msa.InvalidArgumentError, match="fragment_indices must hold integers"):
        msa.make_layout([0, 10, 20], [0, 10, 20], np.array([0.0, 1.0]))


def test_float_document_map_is_refused():
    with pytest.raises(msa.InvalidArgumentError, match="document_map must hold integers"):
        msa.make_layout(document_map=np.full((1, 4), 1.5))
    with pytest.raises(msa.InvalidArgumentError, match="document_map must hold integers"):
        msa.make_layout(document_map=np.ones((2, 4), bool))


def test_integer_metadata_of_any_integer_dtype_is_accepted():
    a = msa.make_layout(np.array([0, 100, 300], np.int64), np.array([0, 100, 300], np.uint16))
    assert a.cu_seqlens_q.tolist() == [0, 100, 300]
    b = msa.make_layout(document_map=np.array([[1, 1, 0]], np.int64))
    assert b.total_q == 2


def test_metadata_outside_int32_is_refused_not_wrapped():
    with pytest.raises(msa.InvalidArgumentError, match="cu_seqlens_q must fit in int32, got the value 4294967396"):
        msa.make_layout(np.array([0, 2**32 + 100], np.int64))
    with pytest.raises(msa.InvalidArgumentError, match="seq_lens must fit in int32"):
        inf.plan_decode(np.array([2**32 + 5], np.int64), np.zeros((1, 1), np.int32), topology=SMALL)


@pytest.mark.parametrize("name", ["seq_lens", "page_table"])
def test_float_inference_metadata_is_refused(name):
    args = dict(seq_lens=np.array([130, 0], np.int32), page_table=np.array([[0, 1], [0, 0]], np.int32))
    args[name] = args[name].astype(np.float64) + 0.5
    with pytest.raises(msa.InvalidArgumentError, match=f"{name} must hold integers"):
        inf.plan_decode(args["seq_lens"], args["page_table"], topology=SMALL)
    with pytest.raises(msa.InvalidArgumentError, match=f"{name} must hold integers"):
        inf.plan_paged_prefill([0, 1, 2], args["seq_lens"], args["page_table"], SMALL)
    with pytest.raises(msa.InvalidArgumentError, match="cu_seqlens_q must hold integers"):
        inf.plan_paged_prefill(np.array([0.0, 1.0, 2.0]), [130, 1], [[0, 1], [2, 0]], SMALL)


def test_torch_functions_check_layout_metadata():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    import msa.torch as mt

    x = torch.zeros(64, 1, 128, dtype=torch.bfloat16)
    for cu in (torch.tensor([0.0, 64.0]), [0, 64.0], np.array([0.0, 64.0])):
        with pytest.raises(msa.InvalidArgumentError, match="cu_seqlens_q must hold integers"):
            mt.select_blocks(x, x, cu)
    # An int64 tensor is read as it is: 2**32 + 64 used to wrap to 64.
    with pytest.raises(msa.InvalidArgumentError, match="cu_seqlens_q must fit in int32"):
        mt.select_blocks(x, x, torch.tensor([0, 2**32 + 64]))
    assert mt.select_blocks(x, x, torch.tensor([0, 64])).shape == (1, 64, 16)


def test_integer_scalars_are_not_truncated():
    with pytest.raises(msa.InvalidArgumentError, match="q_len_per_req must be an integer, got 1.5"):
        inf.plan_decode([10], [[0]], q_len_per_req=1.5, topology=SMALL)


# ---- thread counts -------------------------------------------------------------------------

@pytest.mark.parametrize("threads", [-1, 10**9, 2**40])
def test_out_of_range_thread_counts_are_refused(rng, threads):
    # 10**9 used to reach libgomp, which ran out of memory and ended the interpreter.
    layout = msa.make_layout([0, 200])
    iq = bf16_input(rng, 200, 1, 128)[0]
    with pytest.raises(msa.InvalidArgumentError, match=r"num_threads must be in \[0, \d+\]"):
        msa.select_blocks(iq, iq, layout, num_threads=threads)
    with pytest.raises(msa.InvalidArgumentError, match="num_threads must be in"):
        inf.plan_decode([10], [[0]], topology=SMALL, num_threads=threads)


def test_thread_count_must_be_an_integer(rng):
    layout = msa.make_layout([0, 200])
    iq = bf16_input(rng, 200, 1, 128)[0]
    with pytest.raises(msa.InvalidArgumentError, match="num_threads must be an integer"):
        msa.select_blocks(iq, iq, layout, num_threads=2.5)


def test_thread_counts_in_range_give_the_same_result(rng):
    layout = msa.make_layout([0, 300])
    iq = bf16_input(rng, 300, 1, 128)[0]
    ik = bf16_input(rng, 300, 1, 128)[0]
    want = msa.select_blocks(iq, ik, layout, num_threads=0)
    for threads in (1, 3):
        np.testing.assert_array_equal(msa.select_blocks(iq, ik, layout, num_threads=threads), want)


# ---- empty batches -------------------------------------------------------------------------

@pytest.mark.parametrize("cu", [[0, 0], [0, 0, 0]])
def test_empty_batch_gives_empty_outputs(rng, cu):
    layout = msa.make_layout(cu)
    assert layout.total_q == 0
    q, k, v = bf16_input(rng, 0, 16, 128)[0], bf16_input(rng, 0, 1, 128)[0], bf16_input(rng, 0, 1, 128)[0]
    iq, ik = bf16_input(rng, 0, 1, 128)[0], bf16_input(rng, 0, 1, 128)[0]
    topk, index_lse, plan = msa.prepare(iq, ik, layout)
    assert topk.shape == (1, 0, 16) and index_lse.shape == (1, 0)
    out, lse = msa.forward(q, k, v, topk, layout, plan)
    assert out.shape == (0, 16, 128) and lse.shape == (0, 16)
    dq, dk, dv = msa.backward(np.zeros_like(out), q, k, v, topk, out, lse, layout, plan)
    assert dq.shape == (0, 16, 128) and dk.shape == (0, 1, 128) and dv.shape == (0, 1, 128)
    diq, dik = msa.kl_backward(q, k, lse, iq, ik, index_lse, topk, layout, plan)
    assert diq.shape == (0, 1, 128) and dik.shape == (0, 1, 128)


def test_empty_batch_through_the_torch_ops():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    import msa.torch as mt

    q = torch.zeros(0, 16, 128, dtype=torch.bfloat16, requires_grad=True)
    k = torch.zeros(0, 1, 128, dtype=torch.bfloat16, requires_grad=True)
    v = torch.zeros(0, 1, 128, dtype=torch.bfloat16, requires_grad=True)
    topk = mt.select_blocks(k.detach(), k.detach(), [0, 0])
    assert topk.shape == (1, 0, 16)
    out = mt.sparse_attention(q, k, v, topk, [0, 0])
    assert out.shape == (0, 16, 128)
    out.float().sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


# ---- KV scales: one rule for every format --------------------------------------------------

def _fp8_case(torch, per_token):
    """A one-request decode step over an FP8 cache of 2 pages filled by insert_kv."""
    t = 200
    plan = inf.plan_decode([t], [[1, 0]], topology=SMALL)
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(t, 1, 128, generator=gen) * 0.3).to(torch.bfloat16)
    v = (torch.randn(t, 1, 128, generator=gen) * 0.3).to(torch.bfloat16)
    k_cache = torch.zeros(2, 1, 128, 128, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    shape = (1, 2 * 128) if per_token else (1,)
    k_scale, v_scale = torch.ones(shape), torch.ones(shape)
    slots = torch.tensor([1 * 128 + i if i < 128 else i - 128 for i in range(t)], dtype=torch.int32)
    inf.insert_kv(k, v, slots, k_cache, v_cache, format=inf.KvFormat.fp8_e4m3, k_scale=k_scale, v_scale=v_scale)
    q = (torch.randn(1, 16, 128, generator=gen) * 0.3).to(torch.bfloat16)
    topk = torch.tensor([[[0, 1] + [-1] * 14]], dtype=torch.int32)
    cache = dict(format=inf.KvFormat.fp8_e4m3, k_scale=k_scale, v_scale=v_scale)
    return plan, q, k_cache, v_cache, topk, cache


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("per_token", [False, True])
def test_bad_fp8_scales_are_refused_per_tensor_and_per_token(per_token, bad):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    plan, q, k_cache, v_cache, topk, cache = _fp8_case(torch, per_token)
    out, _ = inf.paged_attention(plan, q, k_cache, v_cache, topk, **cache)
    assert torch.isfinite(out).all()
    name = "v_scale" if per_token else "k_scale"
    # Per token: slot 130 holds position 2 of the request (page 1, offset 2).
    cache[name].view(-1)[130 if per_token else 0] = bad
    want = r"v_scale\[0, 130\] \(request 0, position 2\) must be finite and > 0" if per_token else \
        "k_scale must be finite and > 0"
    with pytest.raises(msa.InvalidArgumentError, match=want):
        inf.paged_attention(plan, q, k_cache, v_cache, topk, **cache)


def test_unused_per_token_scale_slots_are_not_read():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    plan, q, k_cache, v_cache, topk, cache = _fp8_case(torch, True)
    want, _ = inf.paged_attention(plan, q, k_cache, v_cache, topk, **cache)
    # Slots past the request's 200 tokens (page 0, offsets 72..127) hold no token.
    cache["k_scale"][0, 72:128] = 0.0
    got, _ = inf.paged_attention(plan, q, k_cache, v_cache, topk, **cache)
    assert torch.equal(got, want)
