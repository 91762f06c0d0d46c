"""The grouped matmul of a mixture of experts in plain torch: the CPU path for weights in the
model dtype, and the reference the Triton kernel is tested against.

Rows arrive sorted by expert (`counts[e]` rows for expert e, in expert order), so each
expert's rows are one contiguous slice, multiplied by that expert's weight alone:

    x rows:   | e0 e0 e0 | e2 | e3 e3 |        counts = [3, 0, 1, 2]
    weights:    w[0]       w[2]  w[3]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """x: [P, K] sorted by expert; weight: [E, N, K]; counts: [E] -> [P, N]."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            out[start : start + n] = F.linear(x[start : start + n], weight[expert])
            start += n
    return out
