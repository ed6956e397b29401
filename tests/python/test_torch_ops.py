"""PyTorch custom ops on the CPU: values and gradients vs the float64 oracle, opcheck,
torch.compile, determinism and errors."""

import gc
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: msa.torch tests skipped")

import msa  # noqa: E402
import msa.torch as mt  # noqa: E402
import numpy_reference as ref  # noqa: E402

CU = [0, 90, 330]


def inputs(seed=0, cu=CU, hkv=1, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = cu[-1]

    def make(*shape):
        x = (torch.randn(*shape, generator=g) * 0.2).to(torch.bfloat16)
        return x.requires_grad_(requires_grad)

    return dict(q=make(t, 16 * hkv, 128), k=make(t, hkv, 128), v=make(t, hkv, 128), iq=make(t, hkv, 128),
                ik=make(t, 1, 128), cu=torch.tensor(cu, dtype=torch.int32))


def f64(x):
    return x.detach().to(torch.float64).numpy()


def test_forward_and_autograd_match_oracle():
    x = inputs(requires_grad=True)
    layout = msa.make_layout(CU)
    topk = mt.select_blocks(x["iq"], x["ik"], x["cu"])
    out = mt.sparse_attention(x["q"], x["k"], x["v"], topk, x["cu"])
    assert out.dtype == torch.bfloat16 and out.shape == x["q"].shape
    want, _, _ = ref.attention(f64(x["q"]), f64(x["k"]), f64(x["v"]), topk.numpy(), layout)
    assert ref.rel_err(f64(out), want) < 1e-2
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out.backward(dout)
    want_grads = ref.attention_backward(f64(dout), f64(x["q"]), f64(x["k"]), f64(x["v"]), topk.numpy(), f64(out),
                                        layout)
    for name, exp in zip("qkv", want_grads):
        got = x[name].grad
        assert got is not None and got.dtype == torch.bfloat16, name
        assert ref.rel_err(f64(got), exp) < 2e-2, name
        assert ref.cosine(f64(got), exp) > 0.999, name


def test_indexer_kl_loss_gradient_matches_oracle():
    x = inputs(requires_grad=True)
    layout = msa.make_layout(CU)
    topk, index_lse = mt.select_blocks(x["iq"], x["ik"], x["cu"], return_lse=True)
    out, lse = mt.sparse_attention(x["q"], x["k"], x["v"], topk, x["cu"], return_lse=True)
    loss = mt.indexer_kl_loss(x["q"], x["k"], lse, x["iq"], x["ik"], index_lse, topk, x["cu"])
    assert loss.item() == 0.0
    (3.0 * loss).backward()
    assert x["q"].grad is None and x["k"].grad is None  # the teacher is not trained by the KL
    want_q, want_k = ref.kl_backward(f64(x["q"]), f64(x["k"]), f64(x["iq"]), f64(x["ik"]), topk.numpy(), layout)
    assert ref.cosine(f64(x["iq"].grad), 3 * want_q) > 0.99
    assert ref.cosine(f64(x["ik"].grad), 3 * want_k) > 0.99
    assert ref.rel_err(f64(x["iq"].grad), 3 * want_q) < 3e-2


def test_a_layer_step_builds_one_plan():
    """Forward, backward and the indexer's KL of one step share the plan of their top-k tensor;
    a changed or another top-k tensor gets its own, and the plan goes with its tensor."""
    from msa.torch import _ops

    x = inputs(requires_grad=True)
    topk, index_lse = mt.select_blocks(x["iq"], x["ik"], x["cu"], return_lse=True)
    before = _ops._plans.builds
    out, lse = mt.sparse_attention(x["q"], x["k"], x["v"], topk, x["cu"], return_lse=True)
    loss = mt.indexer_kl_loss(x["q"], x["k"], lse, x["iq"], x["ik"], index_lse, topk, x["cu"])
    (out.float().square().sum() + loss).backward()
    assert _ops._plans.builds - before == 1
    grads = [x[n].grad.clone() for n in ("q", "k", "v", "iq", "ik")]

    # The same step on a copy of the selection (a new tensor: a new plan) gives the same results.
    for n in ("q", "k", "v", "iq", "ik"):
        x[n].grad = None
    copy = topk.clone()
    out2, lse2 = mt.sparse_attention(x["q"], x["k"], x["v"], copy, x["cu"], return_lse=True)
    loss2 = mt.indexer_kl_loss(x["q"], x["k"], lse2, x["iq"], x["ik"], index_lse, copy, x["cu"])
    (out2.float().square().sum() + loss2).backward()
    assert _ops._plans.builds - before == 2
    assert torch.equal(out2, out)
    for n, g in zip(("q", "k", "v", "iq", "ik"), grads):
        assert torch.equal(x[n].grad, g), n

    # Changed in place (the version counter moves): the next call builds from the new contents.
    with torch.no_grad():
        out_a = mt.sparse_attention(x["q"], x["k"], x["v"], copy, x["cu"])
        local = copy[:, -1, :].max(dim=-1).values  # the last query keeps its local block only
        copy[:, -1, :] = -1
        copy[:, -1, 0] = local
        out_b = mt.sparse_attention(x["q"], x["k"], x["v"], copy, x["cu"])
    assert _ops._plans.builds - before == 3  # out_a reused the plan, out_b did not
    assert not torch.equal(out_a[-1], out_b[-1])
    gone = weakref.ref(copy)
    del copy, out2, lse2, loss2
    gc.collect()
    assert gone() is None
    assert all(entry[0]() is not None for entry in _ops._plans._plans.values()), "a plan outlived its top-k"


def test_opcheck():
    x = inputs()
    cu = x["cu"]
    topk, index_lse = torch.ops.msa.select_blocks(x["iq"], x["ik"], cu, cu, None, 0, 1, 0.0, 1.0, True, False)
    out, lse = torch.ops.msa.sparse_attention_forward(x["q"], x["k"], x["v"], topk, cu, cu, None, 0.0, False)
    checks = [
        (torch.ops.msa.select_blocks.default, (x["iq"], x["ik"], cu, cu, None, 0, 1, 0.0, 1.0, True, False)),
        (torch.ops.msa.sparse_attention_forward.default,
         (x["q"].requires_grad_(), x["k"].requires_grad_(), x["v"].requires_grad_(), topk, cu, cu, None, 0.0, True)),
        (torch.ops.msa.sparse_attention_backward.default,
         (out.detach(), x["q"].detach(), x["k"].detach(), x["v"].detach(), topk, out.detach(), lse, cu, cu, None, 0.0,
          True)),
        (torch.ops.msa.kl_backward.default,
         (x["q"].detach(), x["k"].detach(), lse, x["iq"], x["ik"], index_lse, topk, cu, cu, None, 0.0, 0.0, 0.0, True)),
        (torch.ops.msa.indexer_kl_loss.default,
         (x["q"].detach(), x["k"].detach(), lse, x["iq"].clone().requires_grad_(), x["ik"].clone().requires_grad_(),
          index_lse, topk, cu, cu, None, 0.0, 0.0, 0.0, True)),
        (torch.ops.msa.merge_states.default, (torch.randn(2, 8, 4, 128), torch.randn(2, 8, 4), True)),
    ]
    for op, args in checks:
        torch.library.opcheck(op, args)


class TinySparseBlock(torch.nn.Module):
    """Projections around the msa ops: what torch.compile must trace through."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(128))

    def forward(self, q, k, v, iq, ik, cu):
        q = (q.float() * self.scale).to(torch.bfloat16)
        topk = mt.select_blocks(iq, ik, cu)
        out = mt.sparse_attention(q, k, v, topk, cu)
        return (out.float() * 2).sum(dim=-1)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_the_ops(backend):
    x = inputs(cu=[0, 100, 200])
    module = TinySparseBlock()
    args = (x["q"], x["k"], x["v"], x["iq"], x["ik"], x["cu"])
    eager = module(*args)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    got = compiled(*args)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-6)
    got.sum().backward()
    assert module.scale.grad is not None and torch.isfinite(module.scale.grad).all()


def test_deterministic_repeats_are_bitwise_identical():
    results = []
    for _ in range(2):
        x = inputs(requires_grad=True)
        topk = mt.select_blocks(x["iq"], x["ik"], x["cu"], deterministic=True)
        out = mt.sparse_attention(x["q"], x["k"], x["v"], topk, x["cu"], deterministic=True)
        out.float().square().sum().backward()
        results.append([topk, out, x["q"].grad, x["k"].grad, x["v"].grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_merge_states_op():
    out_p = torch.randn(3, 5, 4, 128)
    lse_p = torch.randn(3, 5, 4)
    out, lse = mt.merge_states(out_p, lse_p)
    want_out, want_lse = ref.merge_states(out_p.double().numpy(), lse_p.double().numpy())
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=1e-5, atol=1e-5)


def test_select_blocks_takes_fp8_index_inputs():
    # FP8 E4M3 index_q / index_k (scale 1) select exactly as bf16 copies of their values.
    g = torch.Generator().manual_seed(5)
    t = CU[-1]
    iq8 = torch.randn(t, 1, 128, generator=g).to(torch.float8_e4m3fn)
    ik8 = torch.randn(t, 1, 128, generator=g).to(torch.float8_e4m3fn)
    cu = torch.tensor(CU, dtype=torch.int32)
    topk8, lse8 = mt.select_blocks(iq8, ik8, cu, return_lse=True)
    topk16, lse16 = mt.select_blocks(iq8.to(torch.bfloat16), ik8.to(torch.bfloat16), cu, return_lse=True)
    assert torch.equal(topk8, topk16)
    assert torch.equal(lse8, lse16)
    with pytest.raises(ValueError, match="index_q must be bf16 or fp8_e4m3, got f16"):
        mt.select_blocks(iq8.to(torch.float16), ik8, cu)


def test_errors_surface_through_the_ops():
    x = inputs()
    topk = mt.select_blocks(x["iq"], x["ik"], x["cu"])
    with pytest.raises(msa.InvalidArgumentError, match=r"v must have shape \[total_q|v must have shape"):
        mt.sparse_attention(x["q"], x["k"], x["v"][:10], topk, x["cu"])
    with pytest.raises(ValueError, match="q must be bf16|q must have dtype|q has dtype|bf16"):
        mt.sparse_attention(x["q"].float(), x["k"], x["v"], topk, x["cu"])
    with pytest.raises(msa.InvalidArgumentError, match="cu_seqlens_q must be non-decreasing"):
        mt.select_blocks(x["iq"], x["ik"], [0, 200, 100])
    bad = topk.clone()
    bad[0, 3, 1] = 1  # query 3 of the first document sees block 0 only
    with pytest.raises(msa.InvalidArgumentError, match="is not a visible block"):
        mt.sparse_attention(x["q"], x["k"], x["v"], bad, x["cu"])


def test_pack_and_unpack_helpers():
    doc = torch.tensor([[1, 1, 0], [2, 3, 3]], dtype=torch.int32)
    packing = mt.PackingIndex(2, 3, document_map=doc)
    x = torch.arange(6.0).view(2, 3, 1).requires_grad_()
    packed = packing.pack(x)
    assert packed.view(-1).tolist() == [0.0, 1.0, 3.0, 4.0, 5.0]
    assert packing.positions.tolist() == [0, 1, 0, 0, 1]
    back = packing.unpack(packed * 2)
    assert back.view(-1).tolist() == [0.0, 2.0, 0.0, 6.0, 8.0, 10.0]
    back.sum().backward()
    assert x.grad.view(-1).tolist() == [2.0, 2.0, 0.0, 2.0, 2.0, 2.0]


def test_functional_api_takes_torch_tensors():
    x = inputs()
    layout = msa.make_layout(CU)
    topk, index_lse, plan = msa.prepare(x["iq"], x["ik"], layout)
    assert isinstance(topk, torch.Tensor) and topk.dtype == torch.int32
    out, lse = msa.forward(x["q"], x["k"], x["v"], topk, layout, plan, out_dtype="bfloat16")
    assert out.dtype == torch.bfloat16
    want, _ = mt.sparse_attention(x["q"], x["k"], x["v"], topk, x["cu"], return_lse=True)
    assert torch.equal(out, want)
