"""Linear layers laid out for CPU matrix products.

``nn.Linear`` computes ``x @ W.T`` from a weight stored ``[out, in]``; on a CPU, when ``x`` has more than one
row, PyTorch's matrix product repacks that transposed weight at every call, which costs as much as the product
itself. A weight stored ``[in, out]`` needs no repacking (docs/MEASUREMENTS.md has the timings).
"""

from __future__ import annotations

import torch
from torch import nn


class TransposedLinear(nn.Module):
    """``nn.Linear``'s function with the weight kept transposed, ``[in, out]`` and contiguous."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.weight_t
        return out if self.bias is None else out + self.bias


def transpose_linears(module: nn.Module) -> None:
    """Replace every ``nn.Linear`` inside ``module`` by a ``TransposedLinear``, in place."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, TransposedLinear(child))
        else:
            transpose_linears(child)
