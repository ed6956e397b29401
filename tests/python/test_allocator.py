"""The device-allocator hook (msa.set_device_allocator) and pack / unpack through the Python
API: installing, querying and restoring the allocator works on any build; without a CUDA
device nothing ever calls it."""

import numpy as np
import pytest

import msa


@pytest.fixture
def restore_allocator():
    saved = msa.device_allocator()
    yield
    if isinstance(saved, tuple):
        msa.set_device_allocator(*saved)
    else:
        msa.set_device_allocator(None, None)


def test_set_query_and_reset(restore_allocator):
    calls = []

    def allocate(nbytes, device, stream):
        calls.append(("allocate", nbytes, device, stream))
        return 0

    def deallocate(ptr, nbytes, device, stream):
        calls.append(("deallocate", ptr))

    msa.set_device_allocator(allocate, deallocate)
    assert msa.device_allocator() == (allocate, deallocate)
    msa.set_device_allocator(None, None)
    assert msa.device_allocator() is None
    assert calls == []


def test_bad_allocators_are_refused(restore_allocator):
    msa.set_device_allocator(None, None)
    with pytest.raises(ValueError, match="both allocate and deallocate"):
        msa.set_device_allocator(lambda n, d, s: 0, None)
    with pytest.raises(TypeError, match="callables"):
        msa.set_device_allocator(1, 2)
    assert msa.device_allocator() is None  # a refused allocator leaves the default in place


def test_cpu_work_never_calls_the_allocator(restore_allocator, rng):
    calls = []
    msa.set_device_allocator(lambda n, d, s: calls.append(n) or 0, lambda p, n, d, s: calls.append(p))
    doc = np.array([[1, 1, 0, 2], [3, 3, 3, 0]], np.int32)
    layout = msa.make_layout(document_map=doc)
    x = rng.normal(size=(2, 4, 3)).astype(np.float32)
    np.testing.assert_array_equal(msa.unpack(msa.pack(x, layout), layout), np.where(doc[..., None] != 0, x, 0))
    assert calls == []


def test_pack_unpack_torch_cpu_and_layout_metadata():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    doc = torch.tensor([[0, 5, 5, 5, 0, 6], [7, 7, 0, 0, 0, 0]], dtype=torch.int32)
    layout = msa.make_layout(document_map=doc)
    assert list(layout.document_padded_start) == [1, 5, 6]
    assert list(layout.cu_seqlens_q) == [0, 3, 4, 6]
    x = torch.arange(2 * 6 * 2, dtype=torch.float32).reshape(2, 6, 2)
    packed = msa.pack(x, layout, stream=0)
    assert torch.equal(packed, x[doc != 0])
    back = msa.unpack(packed, layout)
    assert torch.equal(back, torch.where(doc[..., None] != 0, x, torch.zeros(())))
    # A non-contiguous CPU map (a transposed view) reads like its contiguous copy.
    t = torch.tensor([[1, 2], [1, 2], [0, 2]], dtype=torch.int32).t()
    assert list(msa.make_layout(document_map=t).cu_seqlens_q) == [0, 2, 5]


def test_msa_torch_leaves_the_default_without_cuda():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    import msa.torch as mt

    if msa.built_with_cuda() and torch.version.cuda is not None:
        pytest.skip("msa and PyTorch both have CUDA: msa.torch installs PyTorch's allocator")
    assert not mt.torch_allocator_in_use()
    assert msa.device_allocator() is None
