"""bf16 on NumPy: uint16 arrays holding bf16 bits, or ml_dtypes.bfloat16 when installed."""

import numpy as np

try:  # optional
    import ml_dtypes as _ml_dtypes

    bfloat16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None
    bfloat16 = None


def from_float(x):
    """Rounds float values to bf16 (nearest even; NaN stays NaN) and returns their bits as uint16."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def to_float(bits):
    """bf16 values (uint16 bits or ml_dtypes.bfloat16) to float32."""
    bits = np.asarray(bits)
    if is_bfloat16(bits.dtype):
        return bits.astype(np.float32)
    if bits.dtype != np.uint16:
        raise TypeError(f"expected uint16 bf16 bits or ml_dtypes.bfloat16, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_float(x):
    """Rounds float values to the nearest bf16 value, kept as float32."""
    return to_float(from_float(x))


def is_bfloat16(dtype):
    """True for ml_dtypes.bfloat16."""
    return bfloat16 is not None and np.dtype(dtype) == bfloat16
