"""MiniMaxM3SparseAttention vs its dense float32 reference (outputs and gradients)."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: msa.torch tests skipped")

import msa  # noqa: E402
import msa.torch as mt  # noqa: E402

CONFIG = dict(hidden_size=256, num_q_heads=16, num_kv_heads=1)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def make_pair(seed=0, **overrides):
    torch.manual_seed(seed)
    layer = mt.MiniMaxM3SparseAttention(**{**CONFIG, **overrides})
    layer.reset_parameters()
    with torch.no_grad():  # non-trivial norm weights
        for norm in (layer.q_norm, layer.k_norm, layer.index_q_norm, layer.index_k_norm):
            norm.weight.normal_(0, 0.3)
    reference = mt.ReferenceSparseAttention(**{**CONFIG, **overrides})
    reference.load_state_dict(layer.state_dict())
    return layer, reference


# Two rows: three documents and padding, then one document longer than two blocks.
DOC = torch.tensor([[1] * 150 + [2] * 100 + [3] * 10 + [0] * 60, [4] * 320], dtype=torch.int32)


def test_output_matches_reference_and_padding_is_zero():
    layer, reference = make_pair()
    x = torch.randn(2, 320, 256)
    with torch.no_grad():
        y = layer(x, document_map=DOC)
        want = reference(x, document_map=DOC)
    assert y.shape == (2, 320, 256)
    assert (y[0, 260:] == 0).all()
    assert rel_err(y, want) < 1e-2 and cosine(y, want) > 0.9999


def test_gradients_match_reference():
    layer, reference = make_pair(1)
    x = torch.randn(2, 320, 256)
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    g = torch.randn(2, 320, 256)
    layer.train()
    (layer(x, document_map=DOC) * g).sum().backward()
    weight = layer.indexer_loss_weight
    (reference(x_ref, document_map=DOC) * g).sum().add(weight * reference.last_indexer_kl).backward()

    main_rows = sum(layer.split_sizes[:3])  # q | k | v rows of the fused projection
    pairs = {
        "x": (x.grad, x_ref.grad),
        "qkv_proj (q, k, v rows)": (layer.qkv_proj.weight.grad[:main_rows], reference.qkv_proj.weight.grad[:main_rows]),
        "o_proj": (layer.o_proj.weight.grad, reference.o_proj.weight.grad),
        "q_norm": (layer.q_norm.weight.grad, reference.q_norm.weight.grad),
        "k_norm": (layer.k_norm.weight.grad, reference.k_norm.weight.grad),
    }
    for name, (got, want) in pairs.items():
        assert got is not None, name
        assert rel_err(got, want) < 3e-2, (name, rel_err(got, want))
        assert cosine(got, want) > 0.999, (name, cosine(got, want))

    # The index branch learns only from the KL; the reference differentiates its dense KL.
    index_pairs = {
        "qkv_proj (index rows)": (layer.qkv_proj.weight.grad[main_rows:], reference.qkv_proj.weight.grad[main_rows:]),
        "index_q_norm": (layer.index_q_norm.weight.grad, reference.index_q_norm.weight.grad),
        "index_k_norm": (layer.index_k_norm.weight.grad, reference.index_k_norm.weight.grad),
    }
    for name, (got, want) in index_pairs.items():
        assert got is not None and got.abs().sum() > 0, name
        assert cosine(got, want) > 0.99, (name, cosine(got, want))
        assert rel_err(got, want) < 0.1, (name, rel_err(got, want))


def test_eval_mode_gives_no_index_gradient():
    layer, _ = make_pair(2)
    layer.eval()
    x = torch.randn(1, 200, 256)
    layer(x, cu_seqlens=[0, 120, 200]).sum().backward()
    main_rows = sum(layer.split_sizes[:3])
    assert layer.qkv_proj.weight.grad[main_rows:].abs().sum() == 0
    assert layer.o_proj.weight.grad.abs().sum() > 0


def test_cu_seqlens_matches_document_map():
    layer, _ = make_pair(3)
    x = torch.randn(1, 260, 256)
    doc = torch.tensor([[1] * 130 + [2] * 100 + [3] * 30], dtype=torch.int32)
    with torch.no_grad():
        a = layer(x, document_map=doc)
        b = layer(x, cu_seqlens=[0, 130, 230, 260])
    assert torch.equal(a, b)


@pytest.mark.parametrize("cu", [[0, 30], [0, 100], [0, 20, 63]])
def test_cu_seqlens_must_cover_the_tokens(cu):
    # Fewer tokens used to zero the rest silently; padding is described by a document map.
    layer, _ = make_pair(3)
    x = torch.randn(1, 64, 256)
    with pytest.raises(msa.InvalidArgumentError, match=r"cu_seqlens must cover the input's batch \* seq = 64"):
        layer(x, cu_seqlens=cu)
    with pytest.raises(msa.InvalidArgumentError, match="cu_seqlens must cover"):
        mt.PackingIndex(1, 64, cu_seqlens=torch.tensor(cu, dtype=torch.int32))


def test_float_layout_metadata_is_refused():
    layer, _ = make_pair(3)
    x = torch.randn(1, 64, 256)
    with pytest.raises(msa.InvalidArgumentError, match="cu_seqlens_q must hold integers"):
        layer(x, cu_seqlens=torch.tensor([0.0, 64.0]))
    with pytest.raises(msa.InvalidArgumentError, match="document_map must hold integers"):
        layer(x, document_map=torch.full((1, 64), 1.7))


def test_bf16_input_needs_bf16_parameters():
    # The README's example: a bf16 batch into the layer converted with the usual idiom.
    torch.manual_seed(7)
    layer = mt.MiniMaxM3SparseAttention(**CONFIG).to(torch.bfloat16)
    x = torch.randn(2, 140, 256, dtype=torch.bfloat16, requires_grad=True)
    doc_map = torch.ones(2, 140, dtype=torch.int32)
    y = layer(x, document_map=doc_map)
    assert y.shape == (2, 140, 256) and y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    # Without the conversion the message says what to do (nn.Linear's is about mat1 / mat2).
    with pytest.raises(msa.InvalidArgumentError, match=r"layer.to\(torch.bfloat16\)"):
        mt.MiniMaxM3SparseAttention(**CONFIG)(x, document_map=doc_map)


def test_selection_beyond_16_blocks_matches_reference():
    # 2200 tokens = 18 blocks: the indexer ranks history blocks. Compare the selections with a
    # tolerance for near-ties (bf16 inputs in msa vs float32 in the reference).
    layer, reference = make_pair(4)
    x = torch.randn(1, 2200, 256)
    doc = torch.ones(1, 2200, dtype=torch.int32)
    with torch.no_grad():
        _, _, _, iq, ik = layer.project(x[0], torch.arange(2200, dtype=torch.int32))
        topk = mt.select_blocks(iq.bfloat16(), ik.bfloat16(), [0, 2200])[0]  # [tokens, 16]
        want = reference.select(x, document_map=doc)[0, 0]  # [tokens, NB] bool
    got = torch.zeros_like(want)
    rows = torch.arange(topk.shape[0])[:, None].expand_as(topk)
    got[rows[topk >= 0], topk[topk >= 0]] = True
    assert (got.sum(-1) == want.sum(-1)).all()
    assert (got != want).any(dim=-1).float().mean() < 0.02  # near-tie swaps only


def test_bf16_parameters():
    torch.manual_seed(5)
    layer = mt.MiniMaxM3SparseAttention(**CONFIG, dtype=torch.bfloat16)
    layer.reset_parameters()
    x = torch.randn(1, 140, 256, dtype=torch.bfloat16)
    y = layer(x, cu_seqlens=[0, 140])
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    y.float().sum().backward()
    assert layer.qkv_proj.weight.grad.dtype == torch.bfloat16


def test_layer_compiles_in_one_graph_with_a_packing_index():
    layer, _ = make_pair(6)
    x = torch.randn(2, 320, 256)
    packing = mt.PackingIndex(2, 320, document_map=DOC)  # host-side work outside the compiled region
    want = layer(x, packing=packing)
    want.square().sum().backward()
    want_grad = layer.qkv_proj.weight.grad.clone()
    layer.zero_grad()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = compiled(x, packing=packing)
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.qkv_proj.weight.grad, want_grad, rtol=1e-4, atol=1e-6)
