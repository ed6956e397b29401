import os
import sys

import numpy as np
import pytest

# One inductor compile worker: the machines that run these tests have few cores.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

sys.path.insert(0, os.path.dirname(__file__))

import msa  # noqa: E402


def bf16_input(rng, *shape, scale=0.2):
    """Random normal * scale rounded to bf16: (bits as uint16, values as float64)."""
    bits = msa.bf16.from_float(rng.normal(size=shape) * scale)
    return bits, msa.bf16.to_float(bits).astype(np.float64)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU, PyTorch with CUDA and msa built with CUDA")
