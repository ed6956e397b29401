"""Context parallelism (msa.torch.context_parallel): the split, and 2- and 4-process runs over
gloo on CPU tensors compared with one process running the whole pack (outputs, LSE,
selection, dq / dk / dv and the indexer's KL gradients, and a whole MiniMax-M3 layer with its
parameter gradients). A NCCL run needs two GPUs and skips otherwise."""

import datetime
import functools
import json
import os
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed: context-parallel tests skipped")
try:
    import msa  # noqa: E402
    import msa.torch as mt  # noqa: E402
    from msa.torch import context_parallel as cp  # noqa: E402
except ImportError as e:  # the native module was not built
    pytest.skip(f"msa's native module is not importable ({e}): context-parallel tests skipped",
                allow_module_level=True)

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

if not dist.is_available():
    pytest.skip("torch.distributed is not available in this PyTorch build", allow_module_level=True)

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKS = REPO / "bench" / "data" / "training_packs_192k.jsonl"

# Documents of 300, 30, 370, 1 and 199 tokens: several blocks, one-token and one-block
# documents, chunk borders inside documents.
CU = [0, 300, 330, 700, 701, 900]
CHUNK = 64
NAMES = ("q", "k", "v", "iq", "ik")


# ---- inputs and the single-process reference ------------------------------------------------

def make_inputs(total, hkv=1, seed=0):
    g = torch.Generator().manual_seed(seed)

    def make(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).to(torch.bfloat16)

    return dict(q=make(total, 16 * hkv, 128), k=make(total, hkv, 128), v=make(total, hkv, 128),
                iq=make(total, hkv, 128), ik=make(total, 1, 128), dout=make(total, 16 * hkv, 128))


def run_single(x, cu, train=True):
    """One process, whole pack: out, lse, topk and the gradients of sum(out * dout) + KL."""
    x = {n: t.clone().requires_grad_(train and n != "dout") for n, t in x.items()}
    cu_t = torch.tensor(cu, dtype=torch.int32)
    with torch.set_grad_enabled(train):
        topk, index_lse = mt.select_blocks(x["iq"], x["ik"], cu_t, return_lse=True)
        out, lse = mt.sparse_attention(x["q"], x["k"], x["v"], topk, cu_t, return_lse=True)
        result = dict(out=out.detach(), lse=lse, topk=topk)
        if train:
            kl = mt.indexer_kl_loss(x["q"], x["k"], lse, x["iq"], x["ik"], index_lse, topk, cu_t)
            (mt.attach_loss(out, kl).float() * x["dout"].float()).sum().backward()
            result.update({"d" + n: x[n].grad for n in NAMES})
    return result


def rel_err(got, want):
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


# ---- process harness ----------------------------------------------------------------------------
# Starting processes costs more than the small cases, so each world size is spawned once and
# runs every case of RUNS in one process group.

LONG_CU, LONG_CHUNK = [0, 2200, 2300], 256
GATHER_CU, GATHER_CHUNK = [0, 10, 200, 333], 32


def make_layer():
    torch.manual_seed(0)
    layer = mt.MiniMaxM3SparseAttention(hidden_size=256, num_q_heads=16, num_kv_heads=1)
    layer.reset_parameters()
    with torch.no_grad():  # non-zero norm weights so that their gradients are exercised too
        for norm in (layer.q_norm, layer.k_norm, layer.index_q_norm, layer.index_k_norm):
            norm.weight.normal_(0, 0.1)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(CU[-1], 256, generator=g)
    weight = torch.randn(CU[-1], 256, generator=g)
    return layer, hidden, weight


def case_ops(rank, world, cu, chunk, train, save_gathered=False):
    x = make_inputs(cu[-1])
    shard = cp.split_for_context_parallel(cu, world, chunk).shard(rank)
    mine = {n: shard.take(t).requires_grad_(train and n != "dout") for n, t in x.items()}
    with torch.set_grad_enabled(train):
        out, lse, topk = cp.context_parallel_sparse_attention(
            mine["q"], mine["k"], mine["v"], mine["iq"], mine["ik"], shard, save_gathered=save_gathered,
            return_lse=True, return_topk=True)
        result = dict(tokens=shard.tokens, out=out.detach(), lse=lse, topk=topk)
        if train:
            (out.float() * mine["dout"].float()).sum().backward()
            result.update({"d" + n: mine[n].grad for n in NAMES})
    return result


def case_layer(rank, world):
    layer, hidden, weight = make_layer()
    split = cp.split_for_context_parallel(CU, world, CHUNK)
    shard = split.shard(rank)
    y = cp.ContextParallelSparseAttention(layer)(shard.take(hidden), shard)
    (y * shard.take(weight)).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    for t in grads.values():  # each rank holds its tokens' share of the parameter gradients
        dist.all_reduce(t)
    return dict(tokens=shard.tokens, y=y.detach(), y_all=cp.gather_tokens(y, split), grads=grads)


def case_gather(rank, world):
    split = cp.split_for_context_parallel(GATHER_CU, world, GATHER_CHUNK)
    rows = torch.arange(split.total_tokens, dtype=torch.float32)[:, None].expand(-1, 3)
    return dict(gathered=cp.gather_tokens(split.shard(rank).take(rows), split))


CASES = {
    # 2 ranks gather K/V again in backward, 4 ranks keep them from forward (save_gathered).
    "ops": lambda rank, world: case_ops(rank, world, CU, CHUNK, True, save_gathered=world == 4),
    "long": lambda rank, world: case_ops(rank, world, LONG_CU, LONG_CHUNK, False),
    "layer": case_layer,
    "gather": case_gather,
}
RUNS = {2: ["ops", "long", "layer", "gather"], 4: ["ops", "gather"]}


def _entry(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        results = {case: CASES[case](rank, world) for case in RUNS[world]}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo(tmp_path_factory):
    """gloo(world)[case] -> the per-rank results of CASES[case] run in `world` processes."""
    done = {}

    def results(world):
        if world not in done:
            out = tmp_path_factory.mktemp(f"gloo{world}")
            saved = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = "1"  # the processes share the machine's cores
            try:
                mp.spawn(_entry, args=(world, str(out / "init"), str(out)), nprocs=world, join=True)
            finally:
                if saved is None:
                    del os.environ["OMP_NUM_THREADS"]
                else:
                    os.environ["OMP_NUM_THREADS"] = saved
            ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
            done[world] = {case: [r[case] for r in ranks] for case in RUNS[world]}
        return done[world]

    return results


@functools.lru_cache(maxsize=None)
def single(case):
    if case == "ops":
        return run_single(make_inputs(CU[-1]), CU)
    if case == "long":
        return run_single(make_inputs(LONG_CU[-1]), LONG_CU, train=False)
    raise KeyError(case)


# ---- the split --------------------------------------------------------------------------------------

def check_split(cu, world, chunk):
    split = cp.split_for_context_parallel(cu, world, chunk)
    total = cu[-1]
    seen = np.zeros(total, dtype=np.int64)
    counts = [len(c) for c in split.chunks]
    assert max(counts) - min(counts) <= 1
    for r in range(world):
        s = split.shard(r)
        toks = s.tokens.numpy()
        assert np.all(np.diff(toks) > 0)
        seen[toks] += 1
        # The local layout builds, and its query positions are the global in-document positions.
        layout = msa.make_layout(s.cu_seqlens_q, s.cu_seqlens_k, s.fragment_indices)
        assert layout.total_q == len(toks) and layout.total_k == s.num_kv_tokens
        np.testing.assert_array_equal(np.asarray(layout.query_positions), s.positions.numpy())
        doc = np.searchsorted(np.asarray(cu), toks, side="right") - 1
        np.testing.assert_array_equal(s.positions.numpy(), toks - np.asarray(cu)[doc])
        # Every fragment's KV range is its document's prefix up to the fragment's last query.
        kv = s.kv_index.numpy()
        kv_global = np.empty_like(kv)
        for rr in range(world):
            mask = kv // split.capacity == rr
            kv_global[mask] = split.rank_tokens[rr][kv[mask] % split.capacity]
        cu_q, cu_k, frag = s.cu_seqlens_q.numpy(), s.cu_seqlens_k.numpy(), s.fragment_indices.numpy()
        for b in range(len(frag)):
            keys = kv_global[cu_k[frag[b]]:cu_k[b + 1]]
            last_query = toks[cu_q[b + 1] - 1]
            d = doc[cu_q[b]]
            np.testing.assert_array_equal(keys, np.arange(cu[d], last_query + 1))
    np.testing.assert_array_equal(seen, 1)  # every token on exactly one rank
    assert split.costs == pytest.approx([split.chunk_costs[c].sum() for c in split.chunks])
    return split


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_split_covers_every_token_once_with_valid_fragment_layouts(world):
    for cu, chunk in ((CU, CHUNK), ([0, 5000], 256), ([0, 1, 2, 3, 700], 100), ([0, 129, 1000, 3333], 128)):
        check_split(cu, world, chunk)


def test_split_balances_useful_work_not_tokens():
    # One long document: contiguous equal-token shards give the last rank far more work
    # (its queries see the most keys); the split evens it out.
    cu = [0, 64 * 1024]
    split = check_split(cu, 8, 1024)
    assert split.imbalance() < 1.01
    cost = cp.token_costs(np.arange(cu[-1]), split.attention_weight, split.indexer_weight)
    contiguous = cost.reshape(8, -1).sum(axis=1)
    assert contiguous.max() / contiguous.mean() > 1.05
    # Every rank still holds the same number of chunks (same token count), mostly in runs of
    # adjacent chunks: fewer query fragments than chunks.
    assert len({len(c) for c in split.chunks}) == 1
    fragments = [split.shard(r).num_fragments for r in range(8)]
    assert max(fragments) <= 6 and sum(fragments) < 8 * 8 * 0.75, fragments


def test_token_cost_is_the_causal_work():
    p = np.array([0, 1, 2047, 2048, 100000])
    np.testing.assert_allclose(cp.token_costs(p, 1.0, 0.0), [1, 2, 2048, 2048, 2048])
    np.testing.assert_allclose(cp.token_costs(p, 0.0, 1.0), p + 1)


@pytest.mark.skipif(not PACKS.exists(), reason=f"{PACKS} is missing")
def test_real_192k_packs_split_evenly_over_16_ranks():
    with open(PACKS) as f:
        packs = [json.loads(line) for _, line in zip(range(40), f)]
    for pack in packs:
        split = cp.split_for_context_parallel(pack["cu_seqlens"], 16, 1024)
        assert [len(c) for c in split.chunks] == [12] * 16  # twelve 1024-token chunks per rank
        assert split.imbalance() < 1.02, pack["case_id"]


def test_split_errors():
    with pytest.raises(msa.InvalidArgumentError, match="fewer than world_size"):
        cp.split_for_context_parallel([0, 100], 4, 64)
    with pytest.raises(msa.InvalidArgumentError, match="non-decreasing"):
        cp.split_for_context_parallel([0, 100, 50], 1, 64)
    with pytest.raises(msa.InvalidArgumentError, match="rank must be in"):
        cp.split_for_context_parallel(CU, 2, CHUNK).shard(2)


def test_single_process_shard_matches_the_plain_ops():
    # world_size 1 without a process group: the fragment layout of one rank is the whole pack.
    x = make_inputs(CU[-1])
    want = single("ops")
    shard = cp.split_for_context_parallel(CU, 1, CHUNK).shard(0)
    mine = {n: shard.take(t).requires_grad_(n != "dout") for n, t in x.items()}
    out = cp.context_parallel_sparse_attention(mine["q"], mine["k"], mine["v"], mine["iq"], mine["ik"], shard)
    (out.float() * mine["dout"].float()).sum().backward()
    assert rel_err(out, want["out"]) < 1e-3
    for n in NAMES:
        assert rel_err(mine[n].grad, want["d" + n]) < 1e-3, n


def test_shape_errors_name_the_argument():
    x = make_inputs(CU[-1])
    shard = cp.split_for_context_parallel(CU, 1, CHUNK).shard(0)
    with pytest.raises(msa.InvalidArgumentError, match=r"k must have shape \[900, H, 128\]"):
        cp.context_parallel_sparse_attention(x["q"], x["k"][:10], x["v"], x["iq"], x["ik"], shard)
    two = cp.split_for_context_parallel(CU, 2, CHUNK).shard(0)
    with pytest.raises(msa.InvalidArgumentError, match="planned for 2"):
        cp.context_parallel_sparse_attention(*(two.take(x[n]) for n in NAMES), two)


# ---- multi-process runs over gloo ------------------------------------------------------------------

def compare_to_single(results, want, out_tol=1e-3, lse_tol=1e-5, grad_tol=2e-3):
    """Per-rank results against the single-process ones at the rank's tokens. Selections are
    compared as sets per row (consumers accept the valid entries in any order)."""
    covered = torch.cat([r["tokens"] for r in results]).sort().values
    assert torch.equal(covered, torch.arange(want["out"].shape[0]))
    for r in results:
        tok = r["tokens"]
        assert torch.equal(r["topk"].sort(-1).values, want["topk"][:, tok].sort(-1).values), "selection differs"
        assert rel_err(r["out"], want["out"][tok]) < out_tol
        finite = torch.isfinite(want["lse"][tok])
        assert torch.equal(torch.isfinite(r["lse"]), finite)
        assert rel_err(r["lse"][finite], want["lse"][tok][finite]) < lse_tol
        if "dq" in want:
            for n in NAMES:
                got = r["d" + n]
                assert got is not None and got.dtype == torch.bfloat16, n
                # dK, dV, d index-K are sums over ranks: equal up to summation order and rounding.
                assert rel_err(got, want["d" + n][tok]) < grad_tol, n


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_matches_single_process(world, gloo):
    compare_to_single(gloo(world)["ops"], single("ops"))


def test_gloo_long_document_selection_and_forward(gloo):
    # A 2,200-token document has 18 blocks: the indexer ranks history blocks whose keys live
    # on the other rank. Forward only, to stay fast on two cores.
    want = single("long")
    compare_to_single(gloo(2)["long"], want)
    assert (want["topk"][:, 2047:2200] >= 0).sum(-1).eq(16).all()  # late queries keep 16 of 17-18 blocks


def test_gloo_layer_and_parameter_gradients_match_single_process(gloo):
    layer, hidden, weight = make_layer()
    y = layer(hidden[None], cu_seqlens=CU)[0]
    (y * weight).sum().backward()
    results = gloo(2)["layer"]
    for r in results:
        assert rel_err(r["y"], y[r["tokens"]]) < 1e-4
        assert rel_err(r["y_all"], y) < 1e-4
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        for r in results:
            assert rel_err(r["grads"][name], p.grad) < 2e-3, name


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_gather_tokens_restores_the_global_order(world, gloo):
    want = torch.arange(GATHER_CU[-1], dtype=torch.float32)[:, None].expand(-1, 3)
    for r in gloo(world)["gather"]:
        assert torch.equal(r["gathered"], want)


# ---- NCCL on GPUs ------------------------------------------------------------------------------------

def _nccl_entry(rank, world, init_file, out_dir, cu, chunk):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        x = {n: t.cuda() for n, t in make_inputs(cu[-1]).items()}
        shard = cp.split_for_context_parallel(cu, world, chunk).shard(rank)
        mine = {n: shard.take(t).requires_grad_(n != "dout") for n, t in x.items()}
        out, lse, topk = cp.context_parallel_sparse_attention(
            mine["q"], mine["k"], mine["v"], mine["iq"], mine["ik"], shard, return_lse=True, return_topk=True)
        (out.float() * mine["dout"].float()).sum().backward()
        result = dict(tokens=shard.tokens, out=out.detach().cpu(), lse=lse.cpu(), topk=topk.cpu(),
                      **{"d" + n: mine[n].grad.cpu() for n in NAMES})
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _gpu_count():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpu_count() < 2 or not dist.is_nccl_available() or not msa.built_with_cuda(),
                    reason="needs 2+ CUDA GPUs, NCCL and msa built with its CUDA backend")
def test_nccl_matches_single_gpu(tmp_path):
    world = min(_gpu_count(), 4)
    cu, chunk = [0, 2200, 2300, 4000, 4100], 256
    mp.spawn(_nccl_entry, args=(world, str(tmp_path / "init"), str(tmp_path), cu, chunk), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    x = {n: t.cuda() for n, t in make_inputs(cu[-1]).items()}
    want = {n: t.cpu() for n, t in run_single(x, cu).items()}
    # The GPU kernels may sum in another order for another layout: bf16 outputs can differ by an ulp.
    compare_to_single(results, want, out_tol=5e-3, lse_tol=1e-4, grad_tol=5e-3)
