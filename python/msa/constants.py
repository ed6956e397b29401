"""The sizes MiniMax-M3's sparse layer fixes, mirroring include/msa/constants.h (a test reads
the header and checks that the two agree). Use these names instead of bare 128 / 16."""

import math

BLOCK_SIZE = 128  # tokens per sparse block (= tokens per cache page)
PAGE_SIZE = BLOCK_SIZE
HEAD_DIM = 128    # head dim of q / k / v and of index q / index k
TOPK = 16         # selected blocks per (token, group), own block included
GROUP_SIZE = 16   # query heads per KV head (and per index head)

LOG2E = 1.0 / math.log(2.0)  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)          # ln(2):   ln(x)  = log2(x) * LN2

__all__ = ["BLOCK_SIZE", "PAGE_SIZE", "HEAD_DIM", "TOPK", "GROUP_SIZE", "LOG2E", "LN2"]
