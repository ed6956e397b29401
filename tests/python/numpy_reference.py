"""The Python tests' view of the float64 NumPy oracle. The oracle itself, the one NumPy
statement of the contract (docs/semantics.md), is tests/independent/oracle_np.py; this module
only adapts its arguments: msa layouts instead of document lists, and the keyword forms the
tests use. No arithmetic of its own."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "independent"))

import oracle_np as oracle  # noqa: E402
from oracle_np import cosine, merge_states, rel_err, topk_to_sets  # noqa: E402,F401


def _settings(init_blocks=0, local_blocks=1, scale=None, index_scale=None, grad_scale=None, head_dim=128):
    return oracle.Settings(init_blocks=init_blocks, local_blocks=local_blocks, softmax_scale=scale,
                           index_scale=index_scale, kl_grad_scale=grad_scale, head_dim=head_dim)


def select_blocks(iq, ik, layout, init_blocks=0, local_blocks=1):
    """(ids [Hi][total_q] in the contract's order, block scores [Hi][total_q]). The scores are
    the unscaled dot products (index scale 1: the same ranking), as the tests' threshold rule
    uses them."""
    settings = _settings(init_blocks, local_blocks, index_scale=1.0, head_dim=iq.shape[2])
    return oracle.select_blocks(oracle.documents_of(layout), iq, ik, settings, iq.shape[0])


def attention(q, k, v, topk, layout, scale=None):
    """(out [total_q, Hq, D], lse [total_q, Hq], None): the third value is kept for callers
    that unpack three."""
    settings = _settings(scale=scale, head_dim=q.shape[2])
    out, lse, _ = oracle.attention_and_kl(oracle.documents_of(layout), q, k, v, None, None, topk, None, settings,
                                          q.shape[0], False)
    return out, lse, None


def attention_backward(dout, q, k, v, topk, out, layout, scale=None):
    """(dq, dk, dv); rowsum(dO o O) uses the given forward output, as a backward does."""
    settings = _settings(scale=scale, head_dim=q.shape[2])
    _, _, grads = oracle.attention_and_kl(oracle.documents_of(layout), q, k, v, None, None, topk, dout, settings,
                                          q.shape[0], True, given_out=out)
    return grads["dq"], grads["dk"], grads["dv"]


def selected_lse(iq, ik, topk, layout, index_scale=None):
    """[Hi, total_q]: natural-log LSE of index_scale <iq, ik> over the selected causal keys."""
    settings = _settings(index_scale=index_scale, head_dim=iq.shape[2])
    return oracle.selected_lse_all(oracle.documents_of(layout), iq, ik, topk, settings, 1.0, iq.shape[0])


def kl_backward(q, k, iq, ik, topk, layout, grad_scale=None, scale=None, index_scale=None):
    """(d index_q, d index_k) of KL(teacher || student) scaled by grad_scale (default
    1 / (Hi * total_q)); the main attention's values do not enter, so v = k and dout = 0."""
    settings = _settings(scale=scale, index_scale=index_scale, grad_scale=grad_scale, head_dim=q.shape[2])
    dout = q * 0.0
    _, _, grads = oracle.attention_and_kl(oracle.documents_of(layout), q, k, k, iq, ik, topk, dout, settings, q.shape[0],
                                          True)
    return grads["dindex_q"], grads["dindex_k"]
