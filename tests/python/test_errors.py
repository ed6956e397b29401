"""Library errors surface as msa.MsaError subclasses carrying the library's message."""

import numpy as np
import pytest

import msa
from conftest import bf16_input


def test_error_hierarchy():
    assert issubclass(msa.InvalidArgumentError, msa.MsaError)
    assert issubclass(msa.InvalidArgumentError, ValueError)
    assert issubclass(msa.UnsupportedError, RuntimeError)
    assert issubclass(msa.MsaRuntimeError, RuntimeError)


def test_bad_shape_names_the_argument(rng):
    layout = msa.make_layout([0, 100])
    q = bf16_input(rng, 100, 16, 64)[0]  # head dim 64 instead of 128
    k = bf16_input(rng, 100, 1, 128)[0]
    topk = msa.select_blocks(k, k, layout)
    with pytest.raises(msa.InvalidArgumentError, match=r"q must have shape \[total_q=100, Hq=16, 128\], got \[100, 16, 64\]"):
        msa.forward(q, k, k, topk, layout)


def test_bad_dtype_is_a_value_error():
    layout = msa.make_layout([0, 10])
    x = np.zeros((10, 1, 128), np.float64)
    with pytest.raises(ValueError, match="index_q has dtype float64"):
        msa.select_blocks(x, x, layout)


def test_bad_layout():
    with pytest.raises(msa.InvalidArgumentError, match="non-decreasing"):
        msa.make_layout([0, 10, 5])
    with pytest.raises(msa.InvalidArgumentError, match="contiguous run"):
        msa.make_layout(document_map=np.array([[1, 2, 1]], np.int32))


def test_invalid_topk_is_rejected_before_writing(rng):
    layout = msa.make_layout([0, 300])
    iq = bf16_input(rng, 300, 1, 128)[0]
    topk = msa.select_blocks(iq, iq, layout)
    topk[0, 5, 1] = 2  # query 5 only sees block 0
    with pytest.raises(msa.InvalidArgumentError, match="is not a visible block"):
        msa.build_plan(topk, layout)


def test_plan_workspace_is_for_cuda_plans(rng):
    layout = msa.make_layout([0, 300])
    iq = bf16_input(rng, 300, 1, 128)[0]
    topk = msa.select_blocks(iq, iq, layout)
    assert msa.plan_workspace_bytes(layout, num_q_heads=16, num_kv_heads=1, device="cpu") == 0
    with pytest.raises(msa.InvalidArgumentError, match="workspace is used by CUDA plans only, but topk is on cpu"):
        msa.build_plan(topk, layout, workspace=np.zeros(1 << 20, np.uint8))
    with pytest.raises(msa.InvalidArgumentError, match=r"device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu0'"):
        msa.plan_workspace_bytes(layout, device="gpu0")
    for call in ("forward", "backward", "kl_backward"):
        assert msa.call_workspace_bytes(layout, call, num_q_heads=16, num_kv_heads=1, device="cpu") == 0
    with pytest.raises(msa.InvalidArgumentError, match=r"call must be 'forward', 'backward' or 'kl_backward', got 'fwd'"):
        msa.call_workspace_bytes(layout, "fwd", device="cpu")


def test_workspace_per_call_is_for_cuda_plans(rng):
    layout = msa.make_layout([0, 300])
    q = bf16_input(rng, 300, 16, 128)[0]
    k = bf16_input(rng, 300, 1, 128)[0]
    topk = msa.select_blocks(k, k, layout)
    with pytest.raises(msa.InvalidArgumentError, match="workspace_per_call means the plan holds no scratch"):
        msa.build_plan(topk, layout, workspace=np.zeros(1 << 20, np.uint8), workspace_per_call=True)
    plan = msa.build_plan(topk, layout, workspace_per_call=True)  # a CPU plan needs none: an ordinary plan
    want, _ = msa.forward(q, k, k, topk, layout)
    got, _ = msa.forward(q, k, k, topk, layout, plan)
    assert np.array_equal(got, want)
    with pytest.raises(msa.InvalidArgumentError, match="sparse_attention_forward workspace is used by CUDA plans only"):
        msa.forward(q, k, k, topk, layout, plan, workspace=np.zeros(1 << 20, np.uint8))


def test_unsupported_topology():
    with pytest.raises(msa.InvalidArgumentError, match="num_q_heads must be 16"):
        msa.Topology(num_q_heads=8, num_kv_heads=1, num_index_heads=1).validate()
