"""CUDA tests: the same ops on CUDA tensors, checked against the CPU backend. They run on a
machine with an NVIDIA GPU, PyTorch with CUDA and msa built with its CUDA backend."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: msa.torch tests skipped")

import msa  # noqa: E402
import msa.torch as mt  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to PyTorch"),
    pytest.mark.skipif(not msa.built_with_cuda(), reason="msa was built without its CUDA backend"),
]

CU = [0, 300, 2500, 2800]  # the second document spans 18 blocks: the indexer ranks history


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def inputs(hkv=4, seed=0, cu=CU):
    g = torch.Generator().manual_seed(seed)
    t = cu[-1]
    make = lambda *shape: (torch.randn(*shape, generator=g) * 0.2).to(torch.bfloat16)  # noqa: E731
    return dict(q=make(t, 16 * hkv, 128), k=make(t, hkv, 128), v=make(t, hkv, 128), iq=make(t, hkv, 128),
                ik=make(t, 1, 128), cu=torch.tensor(cu, dtype=torch.int32))


def to_cuda(x):
    return {k: (v if k == "cu" else v.cuda()) for k, v in x.items()}


def selection_agrees(a, b, min_agreement=0.99):
    """Same count per row and (almost) the same sets: near-ties may swap."""
    va, vb = a >= 0, b >= 0
    assert torch.equal(va.sum(-1), vb.sum(-1))
    assert torch.equal(a.gather(-1, (va.sum(-1, keepdim=True) - 1).clamp_min(0)),
                       b.gather(-1, (vb.sum(-1, keepdim=True) - 1).clamp_min(0)))  # local block last
    same = (a.sort(-1).values == b.sort(-1).values).all(-1).float().mean().item()
    assert same >= min_agreement, same


def test_select_blocks_matches_cpu():
    x = inputs()
    xc = to_cuda(x)
    cpu_topk, cpu_lse = mt.select_blocks(x["iq"], x["ik"], x["cu"], return_lse=True)
    gpu_topk, gpu_lse = mt.select_blocks(xc["iq"], xc["ik"], xc["cu"], return_lse=True)
    assert gpu_topk.is_cuda
    selection_agrees(gpu_topk.cpu(), cpu_topk)
    assert rel_err(gpu_lse.cpu(), cpu_lse) < 1e-3


def test_attention_forward_backward_match_cpu():
    x = inputs()
    topk = mt.select_blocks(x["iq"], x["ik"], x["cu"])
    results = {}
    for device in ("cpu", "cuda"):
        # detach().clone(): .to("cpu") would return the shared input itself, and marking it as
        # requiring grad would make the CUDA copies non-leaf tensors without .grad.
        t = {k: (v if k == "cu" else v.detach().clone().to(device).requires_grad_(k in "qkv")) for k, v in x.items()}
        out = mt.sparse_attention(t["q"], t["k"], t["v"], topk.to(device), t["cu"])
        out.float().square().sum().backward()
        results[device] = [out, t["q"].grad, t["k"].grad, t["v"].grad]
    for name, a, b in zip(("out", "dq", "dk", "dv"), results["cuda"], results["cpu"]):
        assert rel_err(a.cpu(), b) < 1e-2, name
        assert cosine(a.cpu(), b) > 0.999, name


def test_indexer_kl_gradient_matches_cpu():
    x = inputs()
    topk, index_lse = mt.select_blocks(x["iq"], x["ik"], x["cu"], return_lse=True)  # one selection for both
    grads = {}
    for device in ("cpu", "cuda"):
        t = {k: (v if k == "cu" else v.to(device)) for k, v in x.items()}
        iq, ik = t["iq"].clone().requires_grad_(), t["ik"].clone().requires_grad_()
        _, lse = mt.sparse_attention(t["q"], t["k"], t["v"], topk.to(device), t["cu"], return_lse=True)
        mt.indexer_kl_loss(t["q"], t["k"], lse, iq, ik, index_lse.to(device), topk.to(device), t["cu"]).backward()
        grads[device] = (iq.grad, ik.grad)
    for a, b in zip(grads["cuda"], grads["cpu"]):
        assert cosine(a.cpu(), b) > 0.99


def test_layer_matches_cpu():
    torch.manual_seed(0)
    layer = mt.MiniMaxM3SparseAttention(hidden_size=512, num_q_heads=32, num_kv_heads=2)
    layer.reset_parameters()
    x = torch.randn(2, 600, 512)
    doc = torch.tensor([[1] * 400 + [0] * 200, [2] * 300 + [3] * 300], dtype=torch.int32)
    with torch.no_grad():
        want = layer(x, document_map=doc)
        got = layer.cuda()(x.cuda(), document_map=doc)
    assert rel_err(got.cpu(), want) < 1e-2


def test_side_stream_is_honoured():
    x = to_cuda(inputs())
    topk = mt.select_blocks(x["iq"], x["ik"], x["cu"])
    want = mt.sparse_attention(x["q"], x["k"], x["v"], topk, x["cu"])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = mt.sparse_attention(x["q"], x["k"], x["v"], topk, x["cu"])
    torch.cuda.current_stream().wait_stream(stream)
    assert rel_err(got, want) < 1e-6


def _capture(step):
    """Warms `step` up on a side stream, then captures it; returns (graph, step's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def test_torch_allocator_is_in_use():
    assert mt.torch_allocator_in_use()
    x = to_cuda(inputs())
    topk = mt.select_blocks(x["iq"], x["ik"], x["cu"])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    layout = msa.make_layout(CU)
    plan = msa.build_plan(topk, layout)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() > before, "the plan's memory did not come from PyTorch's allocator"
    del plan
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_cuda_graph_capture_and_replay_forward_backward():
    x = to_cuda(inputs(seed=1))
    static = {k: v.clone() for k, v in x.items() if k != "cu"}
    for name in ("q", "k", "v"):
        static[name].requires_grad_(True)
    grad = torch.randn(static["q"].shape, device="cuda").to(torch.bfloat16)
    cu = x["cu"]

    def step():
        topk = mt.select_blocks(static["iq"], static["ik"], cu, deterministic=True)
        out = mt.sparse_attention(static["q"], static["k"], static["v"], topk, cu, deterministic=True)
        dq, dk, dv = torch.autograd.grad(out, (static["q"], static["k"], static["v"]), grad)
        return out, dq, dk, dv

    graph, captured = _capture(step)
    for seed in (2, 3):
        fresh = to_cuda(inputs(seed=seed))
        with torch.no_grad():
            for k in static:
                static[k].copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        q, k, v = (fresh[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
        topk = mt.select_blocks(fresh["iq"], fresh["ik"], cu, deterministic=True)
        out = mt.sparse_attention(q, k, v, topk, cu, deterministic=True)
        want = (out,) + torch.autograd.grad(out, (q, k, v), grad)
        for name, got, ref in zip(("out", "dq", "dk", "dv"), captured, want):
            assert not got.isnan().any(), f"{name}: NaN after replay (seed {seed})"
            assert rel_err(got, ref) < 1e-6, f"{name}: replay differs from eager (seed {seed}): {rel_err(got, ref)}"


def test_cuda_graph_capture_of_the_layer_with_indexer_training():
    torch.manual_seed(0)
    layer = mt.MiniMaxM3SparseAttention(hidden_size=512, num_q_heads=32, num_kv_heads=2, deterministic=True).cuda()
    layer.reset_parameters()
    layer.train()
    doc = torch.tensor([[1] * 400 + [0] * 200, [2] * 300 + [3] * 300], dtype=torch.int32)
    packing = mt.PackingIndex(2, 600, document_map=doc, device="cuda")  # host work: before the capture
    x = torch.randn(2, 600, 512, device="cuda", requires_grad=True)
    params = [p for p in layer.parameters()]

    def step():
        y = layer(x, packing=packing)
        grads = torch.autograd.grad(y.float().square().sum(), [x] + params)
        return (y,) + grads

    graph, captured = _capture(step)
    with torch.no_grad():
        x.copy_(torch.randn(2, 600, 512, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = step()
    names = ["y", "dx"] + [n for n, _ in layer.named_parameters()]
    for name, got, ref in zip(names, captured, want):
        assert rel_err(got, ref) < 1e-5, f"{name}: replay differs from eager: {rel_err(got, ref)}"


def test_a_layer_step_builds_one_plan_on_cuda():
    """Forward, KL and backward of one step share one plan (its scratch comes per call); the
    results equal those of a step whose ops each build their own plan, bit for bit."""
    from msa.torch import _ops

    x = to_cuda(inputs(seed=4))
    cu = x["cu"]
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "iq", "ik")}

    def step(share):
        q, k, v, iq, ik = (leaves[n] for n in ("q", "k", "v", "iq", "ik"))
        topk, index_lse = mt.select_blocks(iq, ik, cu, return_lse=True, deterministic=True)
        own = (lambda t: t) if share else (lambda t: t.clone())  # a clone is another tensor: another plan
        out, lse = mt.sparse_attention(q, k, v, own(topk), cu, return_lse=True, deterministic=True)
        loss = mt.indexer_kl_loss(q, k, lse, iq, ik, index_lse, own(topk), cu, deterministic=True)
        grads = torch.autograd.grad(out.float().square().sum() + loss, [q, k, v, iq, ik])
        return (out,) + grads

    before = _ops._plans.builds
    shared = step(share=True)
    torch.cuda.synchronize()
    assert _ops._plans.builds - before == 1
    separate = step(share=False)
    assert _ops._plans.builds - before == 3
    for name, got, want in zip(("out", "dq", "dk", "dv", "diq", "dik"), shared, separate):
        assert not got.isnan().any(), name
        assert torch.equal(got, want), name


def test_layout_pack_and_unpack_on_cuda_match_cpu():
    g = torch.Generator().manual_seed(0)
    doc = torch.zeros(3, 700, dtype=torch.int32)
    doc[0, :300], doc[0, 300:650], doc[1, 10:700], doc[2, :5] = 4, 9, 1, 2
    cpu = msa.make_layout(document_map=doc)
    gpu = msa.make_layout(document_map=doc.cuda())
    assert list(gpu.cu_seqlens_q) == list(cpu.cu_seqlens_q)
    assert (gpu.packed_row_of_padded == cpu.packed_row_of_padded).all()
    padded = torch.randn(3, 700, 4, 33, generator=g).to(torch.bfloat16)
    want = msa.pack(padded, cpu)
    got = msa.pack(padded.cuda(), gpu)
    assert got.is_cuda and torch.equal(got.cpu(), want)
    assert torch.equal(msa.unpack(got, gpu).cpu(), msa.unpack(want, cpu))
    with pytest.raises(msa.InvalidArgumentError, match="not one contiguous run"):
        bad = doc.clone()
        bad[0, 690] = 4
        msa.make_layout(document_map=bad.cuda())


def test_deterministic_mode_is_bitwise_reproducible_on_cuda():
    x = to_cuda(inputs())
    runs = []
    for _ in range(2):
        t = {k: (v if k == "cu" else v.clone().requires_grad_(k in "qkv")) for k, v in x.items()}
        topk = mt.select_blocks(t["iq"], t["ik"], t["cu"], deterministic=True)
        out = mt.sparse_attention(t["q"], t["k"], t["v"], topk, t["cu"], deterministic=True)
        out.float().square().sum().backward()
        runs.append([topk, out, t["q"].grad, t["k"].grad, t["v"].grad])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_functional_api_on_cuda_tensors():
    # The functional API accepts CUDA tensors too (outputs on the same device).
    x = to_cuda(inputs())
    layout = msa.make_layout(CU)
    topk, lse, plan = msa.prepare(x["iq"], x["ik"], layout)
    assert topk.is_cuda and plan.device.startswith("cuda")
    out, lse = msa.forward(x["q"], x["k"], x["v"], topk, layout, plan)
    assert out.is_cuda and out.dtype == torch.float32


def test_plans_sharing_a_caller_workspace_match_a_plan_with_its_own():
    x = to_cuda(inputs())
    layout = msa.make_layout(CU)
    topk = msa.select_blocks(x["iq"], x["ik"], layout)
    want_out, want_lse = msa.forward(x["q"], x["k"], x["v"], topk, layout, msa.build_plan(topk, layout))
    nbytes = msa.plan_workspace_bytes(layout, device=x["q"].device)
    assert nbytes >= 16 * CU[-1] * 64 * 128 * 2  # the forward's partial outputs alone
    workspace = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device="cuda")  # NaN bytes
    plan = msa.build_plan(topk, layout, workspace=workspace)
    other = msa.build_plan(topk.flip(0).contiguous(), layout, workspace=workspace)
    del workspace  # the plans keep it alive
    msa.forward(x["q"], x["k"], x["v"], topk.flip(0).contiguous(), layout, other)
    out, lse = msa.forward(x["q"], x["k"], x["v"], topk, layout, plan)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(msa.InvalidArgumentError, match="must hold at least plan_workspace_bytes"):
        msa.build_plan(topk, layout, workspace=torch.empty(nbytes - 1, dtype=torch.uint8, device="cuda"))


def test_each_call_runs_on_its_own_workspace_bytes():
    # A plan without scratch: each call gets exactly call_workspace_bytes of NaN bytes (the
    # default backward's fp32 accumulators are a fraction of the forward's partials), and one
    # byte fewer is refused by name.
    x = to_cuda(inputs())
    layout = msa.make_layout(CU)
    topk = msa.select_blocks(x["iq"], x["ik"], layout)
    want_out, want_lse = msa.forward(x["q"], x["k"], x["v"], topk, layout, msa.build_plan(topk, layout))
    plan = msa.build_plan(topk, layout, workspace_per_call=True)
    sizes = {call: msa.call_workspace_bytes(layout, call, device="cuda") for call in ("forward", "backward")}
    assert sizes["backward"] < sizes["forward"] <= msa.plan_workspace_bytes(layout, device="cuda")
    nan = lambda n: torch.full((n,), 0xFF, dtype=torch.uint8, device="cuda")  # noqa: E731
    out, lse = msa.forward(x["q"], x["k"], x["v"], topk, layout, plan, workspace=nan(sizes["forward"]))
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    dout = torch.randn_like(out)
    grads = msa.backward(dout, x["q"], x["k"], x["v"], topk, out, lse, layout, plan, workspace=nan(sizes["backward"]))
    want = msa.backward(dout, x["q"], x["k"], x["v"], topk, out, lse, layout, msa.build_plan(topk, layout))
    for got, ref in zip(grads, want):  # both fp32 atomics: equal up to the order of their additions
        assert rel_err(got, ref) < 1e-5
    with pytest.raises(msa.InvalidArgumentError, match=r"must hold at least call_workspace_bytes\(backward\)"):
        msa.backward(dout, x["q"], x["k"], x["v"], topk, out, lse, layout, plan, workspace=nan(sizes["backward"] - 1))


def test_allocator_errors_reach_the_caller_and_the_default_comes_back():
    x = to_cuda(inputs())
    topk = mt.select_blocks(x["iq"], x["ik"], x["cu"])
    layout = msa.make_layout(CU)
    saved = msa.device_allocator()

    def refuse(nbytes, device, stream):
        raise MemoryError(f"refused {nbytes} bytes")

    try:
        msa.set_device_allocator(refuse, lambda ptr, nbytes, device, stream: None)
        with pytest.raises(MemoryError, match="refused"):
            msa.build_plan(topk, layout)
        msa.set_device_allocator(None, None)  # msa's own cudaMalloc
        plan = msa.build_plan(topk, layout)
        out, _ = msa.forward(x["q"], x["k"], x["v"], topk, layout, plan)
        assert not out.isnan().any()
    finally:
        if isinstance(saved, tuple):
            msa.set_device_allocator(*saved)
        else:
            msa.set_device_allocator(None, None)
