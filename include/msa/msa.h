// msa: MiniMax Sparse Attention. Include this header for the whole public API.
#pragma once

#include "msa/dtype.h"
#include "msa/error.h"
#include "msa/inference.h"
#include "msa/layout.h"
#include "msa/ops.h"
#include "msa/tensor.h"
#include "msa/topology.h"
#include "msa/version.h"
