"""msa.constants mirrors include/msa/constants.h: read the header and compare every value."""

import pathlib
import re

import numpy as np
import pytest

import msa.constants as c

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "msa" / "constants.h"
# C++ name -> Python name; a constant added to the header must be added to both.
NAMES = {"kBlockSize": "BLOCK_SIZE", "kPageSize": "PAGE_SIZE", "kHeadDim": "HEAD_DIM", "kTopk": "TOPK",
         "kGroupSize": "GROUP_SIZE", "kLog2e": "LOG2E", "kLn2": "LN2"}


def header_constants():
    """{name: (type, value)} of the header's `inline constexpr` definitions; a value naming an
    earlier constant takes its value."""
    found = {}
    pattern = re.compile(r"inline\s+constexpr\s+(int|float|double)\s+(\w+)\s*=\s*([^;]+);")
    for kind, name, expr in pattern.findall(HEADER.read_text()):
        expr = expr.strip()
        if expr in found:
            found[name] = (kind, found[expr][1])
        elif kind == "int":
            found[name] = (kind, int(expr))
        else:
            found[name] = (kind, float(expr.rstrip("fF")))
    return found


@pytest.mark.skipif(not HEADER.exists(), reason="the C++ headers are not next to the tests (installed package)")
def test_python_constants_match_the_header():
    header = header_constants()
    assert set(header) == set(NAMES), "constants.h and msa/constants.py must name the same constants"
    for cname, (kind, value) in header.items():
        mine = getattr(c, NAMES[cname])
        if kind == "int":
            assert isinstance(mine, int) and mine == value, (cname, mine, value)
        else:  # the header's are float: equal once rounded to float32
            assert np.float32(mine) == np.float32(value), (cname, mine, value)
    assert c.LOG2E * c.LN2 == pytest.approx(1.0, rel=1e-15)
