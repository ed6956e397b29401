"""MiniMax-M3 in Hugging Face transformers: attn_implementation="msa" against transformers' own
"sdpa" path (its indexer + a dense block mask), on a tiny random text model with one sparse and
one full-attention layer (16 query heads / 1 KV head / 1 index head, head dim 128, bf16).

Sequences are longer than 16 blocks (2304 tokens = 18 blocks) so that the selection really
drops blocks. Semantic differences to transformers' indexer are checked here and described in
docs/transformers.md."""

import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: transformers tests skipped")
pytest.importorskip("transformers", reason="transformers is not installed: transformers integration tests skipped")
try:
    from transformers import AutoModelForCausalLM
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
except ImportError as e:  # transformers older than 5.17 has no MiniMax-M3
    pytest.skip(f"this transformers has no MiniMax-M3 model ({e})", allow_module_level=True)

import msa  # noqa: E402
import msa.integrations.transformers as msa_hf  # noqa: E402
import msa.torch as mt  # noqa: E402
from msa.constants import BLOCK_SIZE, TOPK  # noqa: E402

msa_hf.register()

SEQ = 18 * BLOCK_SIZE  # 2304 tokens: queries of the last blocks drop blocks
BF16_LOGITS_REL = 2e-2  # relative L2 of bf16 logits (msa accumulates in fp32, sdpa on the CPU partly in bf16)
GRAD_REL = 5e-2         # relative L2 of a parameter's gradient after one bf16 training step


def text_config(**overrides):
    base = dict(vocab_size=512, hidden_size=256, intermediate_size=256, dense_intermediate_size=256,
                shared_intermediate_size=256, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=1,
                head_dim=128, index_n_heads=1, index_head_dim=128, index_block_size=BLOCK_SIZE,
                index_topk_blocks=TOPK, index_local_blocks=1,
                layer_types=["minimax_m3_sparse", "full_attention"], mlp_layer_types=["dense", "dense"],
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
                max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    base.update(overrides)
    return MiniMaxM3VLTextConfig(**base)


def make_model(seed=0, dtype=torch.bfloat16, implementation="sdpa", **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(text_config(**overrides), attn_implementation=implementation, dtype=dtype)
    with torch.no_grad():  # non-trivial norm weights (they start at 0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model.eval()


def use(model, implementation):
    model.set_attn_implementation(implementation)
    return model


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def tokens(batch, seq, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (batch, seq), generator=g)


@pytest.fixture(scope="module")
def model():
    return make_model()


def assert_same_greedy(ref_out, got_out, margin=0.05):
    """Greedy tokens equal, except where the reference's top-2 logits are within `margin` (a near
    tie that bf16 rounding may flip); the sequences are compared up to such a step."""
    ref, got = ref_out.sequences, got_out.sequences
    assert ref.shape == got.shape
    start = ref.shape[1] - len(ref_out.scores)
    for step, scores in enumerate(ref_out.scores):
        for row in range(ref.shape[0]):
            if ref[row, start + step] != got[row, start + step]:
                top2 = scores[row].float().topk(2).values
                assert (top2[0] - top2[1]).item() < margin, (
                    f"row {row} step {step}: msa chose {got[row, start + step].item()}, sdpa "
                    f"{ref[row, start + step].item()} with a logit margin of {(top2[0] - top2[1]).item():.3f}")
                return
        assert rel(got_out.scores[step].float(), scores.float()) < BF16_LOGITS_REL


# ---- the indexer: transformers' selection vs msa's ------------------------------------------

def indexer_inputs(model, ids):
    layer = model.model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(ids))
    pos = torch.arange(ids.shape[1])[None]
    return layer.self_attn.indexer, x, model.model.rotary_emb(x, pos), pos


def both_selections(model, ids, local_blocks=1):
    """(transformers' block_indices [S, 16] of the one index head, msa's top-k [S, 16])."""
    indexer, x, pe, pos = indexer_inputs(model, ids)
    with torch.no_grad():
        use(model, "sdpa")
        hf = indexer(x, pe, None, pos)[0, 0]
        use(model, "msa")
        state = indexer(x, pe, None, pos)
        iq = state.index_q[0].transpose(0, 1).to(torch.bfloat16)
        ik = state.index_k[0].transpose(0, 1).to(torch.bfloat16)
        n = ids.shape[1]
        ours = mt.select_blocks(iq, ik, [0, n], local_blocks=local_blocks)[0]
    return hf, ours, state


def as_sets(rows):
    return [frozenset(int(v) for v in r if v >= 0) for r in rows]


@pytest.mark.parametrize("local_blocks", [1, 2])
def test_selection_equals_transformers_indexer(local_blocks):
    """Same blocks as transformers' indexer for every query: the local-block boost (+inf on the
    query's own and preceding local blocks, then top-16) equals msa's forced local blocks plus the
    best others, and both count min(16, visible blocks). Only near-ties may differ."""
    model = make_model(seed=3, index_local_blocks=local_blocks)
    ids = tokens(1, SEQ, seed=3)
    hf, ours, state = both_selections(model, ids, local_blocks)
    hf_sets, our_sets = as_sets(hf), as_sets(ours)
    pos = torch.arange(SEQ)
    for p in (0, 127, 128, 2047, 2048, SEQ - 1):
        assert len(our_sets[p]) == min(TOPK, p // BLOCK_SIZE + 1)
        assert all(p // BLOCK_SIZE - o in our_sets[p] for o in range(min(local_blocks, p // BLOCK_SIZE + 1)))
    # fp32 block scores as transformers computes them, to recognise near-ties
    scores = state.index_q[0, 0].float() @ state.index_k[0, 0].float().T
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    block = scores.view(SEQ, SEQ // BLOCK_SIZE, BLOCK_SIZE).amax(-1)
    differ = [p for p in range(SEQ) if hf_sets[p] != our_sets[p]]
    for p in differ:
        only = sorted(hf_sets[p] ^ our_sets[p])
        s = block[p, only]
        assert (s.max() - s.min()).abs().item() <= 1e-3 * s.abs().max().item() + 1e-4, (
            f"query {p}: transformers selected {sorted(hf_sets[p])}, msa {sorted(our_sets[p])}")
    assert len(differ) <= SEQ // 1000
    assert sum(len(s) < p // BLOCK_SIZE + 1 for p, s in enumerate(our_sets)) > 0  # blocks were dropped


def test_ties_go_to_the_lower_block_id():
    """All index scores equal (zero index-key projection): msa keeps the 15 lowest block ids plus
    the local block (MSA's rule: score desc, block id asc). transformers' torch.topk picks some
    16 blocks among the equal ones in an order the PyTorch kernel decides."""
    model = make_model(seed=4)
    with torch.no_grad():
        model.model.layers[0].self_attn.indexer.k_proj.weight.zero_()
    hf, ours, _ = both_selections(model, tokens(1, SEQ, seed=4))
    last = SEQ - 1
    local = last // BLOCK_SIZE
    assert as_sets(ours)[last] == frozenset(range(TOPK - 1)) | {local}
    assert ours[last, TOPK - 1].item() == local  # msa's contract: the local block is the last valid entry
    hf_set = as_sets(hf)[last]
    assert len(hf_set) == TOPK and local in hf_set  # same size and local block, members up to torch.topk


# ---- whole model: prefill, training, generate ------------------------------------------------

def test_prefill_logits_and_training_gradients_match_sdpa(model):
    """One training step on 2304 tokens through both implementations: logits and every
    parameter's gradient agree within bf16 tolerances; the index projections get no gradient
    from either (transformers' selection is not differentiable; msa's KL is off by default)."""
    ids = tokens(1, SEQ)
    results = {}
    for impl in ("sdpa", "msa"):
        use(model, impl).train()
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        results[impl] = (out.logits.detach().float(), out.loss.item(),
                         {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    model.eval()
    (ref_logits, ref_loss, ref_grads), (logits, loss, grads) = results["sdpa"], results["msa"]
    assert rel(logits, ref_logits) < BF16_LOGITS_REL
    assert abs(loss - ref_loss) < 1e-2 * abs(ref_loss)
    for name, g in grads.items():
        if ".indexer." in name:
            assert g is None and ref_grads[name] is None, name
            continue
        assert g is not None and torch.isfinite(g).all(), name
        assert rel(g, ref_grads[name]) < GRAD_REL, (name, rel(g, ref_grads[name]))


GENERATE = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.fixture(scope="module")
def sdpa_generated(model):
    with torch.no_grad():
        return use(model, "sdpa").generate(tokens(1, SEQ, seed=5), **GENERATE)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_matches_sdpa(model, sdpa_generated, cache):
    """Greedy generate of 4 tokens after 2304 prompt tokens with transformers' dynamic / static
    cache (index-K cache layer included): the decode queries select 16 of 19 blocks."""
    with torch.no_grad():
        got = use(model, "msa").generate(tokens(1, SEQ, seed=5), cache_implementation=cache, **GENERATE)
    assert_same_greedy(sdpa_generated, got)


# ---- padding and packed sequences ------------------------------------------------------------

def test_left_and_right_padding_equal_unpadded_rows(model):
    """A padded batch gives each row's unpadded result: msa anchors blocks on the row's first real
    token (transformers' own indexer anchors them on slots, which differs under left padding), and
    padded keys are never selected. Left-padded batch generate continues each row as if alone."""
    use(model, "msa")
    ids = tokens(2, SEQ, seed=6)
    pad = 200
    row = ids[1:, pad:]  # the padded row's real tokens: 2104, still more than 16 blocks
    left = ids.clone()
    left[1, :pad] = 0
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    kw = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        alone = model(row, use_cache=False).logits[0].float()
        right = torch.cat([row, torch.zeros(1, pad, dtype=ids.dtype)], dim=1)
        got = model(right, attention_mask=mask.flip(1)[1:], use_cache=False).logits[0, :SEQ - pad].float()
        assert rel(got, alone) < 1e-2

        batched = model.generate(left, attention_mask=mask, **kw)  # dynamic cache, left padding
        one = model.generate(row, **kw)
    assert rel(one.scores[0][0].float(), alone[-1]) < 1e-2
    mine = type(one)(sequences=batched.sequences[1:], scores=[s[1:] for s in batched.scores])
    ref = type(one)(sequences=torch.cat([torch.zeros(1, pad, dtype=ids.dtype), one.sequences], 1), scores=one.scores)
    assert_same_greedy(ref, mine)


def test_packed_sequences_equal_separate_documents(model):
    """position_ids restarting at 0 (no attention mask, use_cache=False) split a row into
    documents, as transformers' SDPA mask does for its dense layers; transformers' own indexer
    compares slots with positions there and cannot express it."""
    use(model, "msa")
    a, b = 2200, 300
    ids = tokens(1, a + b, seed=7)
    pos = torch.cat([torch.arange(a), torch.arange(b)])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=pos, use_cache=False).logits[0].float()
        first = model(ids[:, :a], use_cache=False).logits[0].float()
        second = model(ids[:, a:], use_cache=False).logits[0].float()
    assert rel(packed[:a], first) < 1e-2
    assert rel(packed[a:], second) < 1e-2


def test_indexer_kl_option_trains_the_index_projections():
    model = make_model(seed=8)
    msa_hf.register(indexer_loss_weight=1.0)
    try:
        use(model, "msa").train()
        ids = tokens(1, 3 * BLOCK_SIZE, seed=8)
        model(ids, labels=ids, use_cache=False).loss.backward()
    finally:
        msa_hf.register()
    for name, p in model.named_parameters():
        if ".indexer." in name and "proj" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


# ---- what is refused --------------------------------------------------------------------------

def test_refusals_name_the_cause(model):
    use(model, "msa")
    ids = tokens(1, 256, seed=9)
    with torch.no_grad():
        restart = torch.cat([torch.arange(128), torch.arange(128)])[None]
        with pytest.raises(msa.InvalidArgumentError, match="use_cache=False"):
            model(ids, position_ids=restart)  # a cache is made: transformers' masks do not separate them
        hole = torch.ones_like(ids)
        hole[0, 100:110] = 0
        with pytest.raises(msa.InvalidArgumentError, match="padding between real tokens"):
            model(ids, attention_mask=hole, use_cache=False)
    for overrides, what in ((dict(index_topk_blocks=8), "index_topk_blocks"),
                            (dict(num_attention_heads=8, num_key_value_heads=1), "num_attention_heads"),
                            (dict(num_key_value_heads=2, num_attention_heads=32, index_n_heads=1), "index_n_heads")):
        bad = make_model(implementation="msa", **overrides)
        with pytest.raises(msa.InvalidArgumentError, match=what), torch.no_grad():
            bad(ids, use_cache=False)


def test_dense_layers_and_other_implementations_are_untouched(model):
    """The routed indexer only acts for "msa": "sdpa" still returns transformers' block indices."""
    indexer, x, pe, pos = indexer_inputs(model, tokens(1, 300, seed=10))
    with torch.no_grad():
        use(model, "sdpa")
        out = indexer(x, pe, None, pos)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 1, 300, 3)
    assert msa_hf.register() == "msa"  # idempotent


def test_transformers_indexer_is_slot_anchored_under_left_padding():
    """Why msa does not copy transformers here: with left padding (positions counted from the
    first real token, as generate makes them), transformers' indexer takes key blocks from slots
    and the query block from the position, so a padded row attends to other tokens than the same
    row unpadded (its docstring's TODO); pad keys can even be chosen. msa's blocks start at the
    row's first real token, so its selection does not depend on padding."""
    model = make_model(seed=11)
    pad = 200
    ids = tokens(1, SEQ - pad, seed=11)
    padded = torch.cat([torch.zeros(1, pad, dtype=ids.dtype), ids], dim=1)
    indexer, x, pe, pos = indexer_inputs(model, ids)
    _, xp, _, _ = indexer_inputs(model, padded)
    pos_p = torch.cat([torch.ones(1, pad, dtype=pos.dtype), pos], dim=1)  # generate's position_ids for pad
    pe_p = model.model.rotary_emb(xp, pos_p)
    with torch.no_grad():
        use(model, "sdpa")
        plain = indexer(x, pe, None, pos)[0, 0]
        shifted = indexer(xp, pe_p, None, pos_p)[0, 0, pad:]

    def tokens_seen(sel, offset):  # real-token indices each query's selected blocks cover
        return [frozenset(t - offset for b in r.tolist() if b >= 0
                          for t in range(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE) if 0 <= t - offset <= q)
                for q, r in enumerate(sel)]

    assert tokens_seen(shifted, pad) != tokens_seen(plain, 0)


def test_layout_of_padded_cached_and_packed_batches():
    """The packed layout the attention function builds: documents, bottom-right aligned queries."""
    build = msa_hf._build_layout
    # no padding, no cache: a reshape, one document per row
    lay = build(None, torch.arange(5)[None], False, None, 2, 5, 5, "cpu")
    assert lay.q_rows is None and lay.cu_q.tolist() == [0, 5, 10] and lay.cu_k.tolist() == [0, 5, 10]
    # packed: positions restarting split the row, still a reshape
    lay = build(None, torch.tensor([[0, 1, 2, 0, 1]]), False, None, 1, 5, 5, "cpu")
    assert lay.q_rows is None and lay.cu_q.tolist() == [0, 3, 5]
    # decode after left padding: row 1 has 2 pad slots; one query per row at the end
    pad = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    lay = build(pad, torch.tensor([[4], [2]]), True, None, 2, 1, 5, "cpu")
    assert lay.cu_q.tolist() == [0, 1, 2] and lay.cu_k.tolist() == [0, 5, 8]
    assert lay.k_slots.tolist() == [0, 1, 2, 3, 4, 2, 3, 4] and lay.q_slots.tolist() == [0, 0]
    # static cache: 8 slots, 3 filled after this 1-token step; unfilled slots are not keys
    filled = torch.tensor([3])
    lay = build(None, torch.tensor([[2]]), True, filled, 1, 1, 8, "cpu")
    assert lay.cu_k.tolist() == [0, 3] and lay.k_slots.tolist() == [0, 1, 2]
    # right padding in prefill: padded queries are left out (their output rows stay 0)
    pad = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    lay = build(pad, torch.arange(4)[None], False, None, 1, 4, 4, "cpu")
    assert lay.cu_q.tolist() == [0, 3] and lay.q_slots.tolist() == [0, 1, 2]
    with pytest.raises(msa.InvalidArgumentError, match="jump"):
        build(None, torch.tensor([[0, 1, 2, 0, 1]]), True, None, 1, 5, 5, "cpu")


def test_gradient_checkpointing_gives_the_same_gradients():
    model = use(make_model(seed=12), "msa").train()
    ids = tokens(1, 3 * BLOCK_SIZE, seed=12)
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids, use_cache=False).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert rel(grads[1][name], g) < 1e-2, name
