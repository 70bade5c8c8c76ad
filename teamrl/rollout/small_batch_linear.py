"""Linear layers at decode batch sizes on CPU, computed as ``(W @ x^T)^T`` instead of ``x @ W^T``.

A decode step multiplies a few rows (one new token per sequence) by every weight matrix. With
MKL on CPU, ``torch.mm(W, x^T)`` runs these shapes faster than ``F.linear``'s ``x @ W^T``:
measured on this project's 2-core AVX2 machine (fp32, SmolLM2-135M shapes, 16 rows), the
576 x 49152 output head took 31 ms instead of 72 ms and a 576 -> 1536 MLP matrix 0.68 ms instead
of 1.14 ms; from ~128 rows on the two are equal. The product is the same (each output is one dot
product of a row and a weight column), only the order of MKL's blocking differs.

MKL's kernels for these shapes are also fastest at row counts that are multiples of 8: on the same
machine 15 rows took 1.21 ms through the 576 -> 1536 matrix and 51 ms through the output head,
16 rows 0.87 and 28 ms. Calls whose row count is 5-7 past a multiple of 8 (13-15, 21-23, ...)
are therefore padded with zero rows up to the next multiple; the padding's outputs are dropped.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows (tokens) per call the transposed product is used; above, F.linear.
SMALL_BATCH_ROWS = 64
# Row counts this far or more past a multiple of 8 are padded up to the next multiple (measured, see above).
PAD_FROM_REMAINDER = 5


def padded_rows(rows: int) -> int:
    """The row count a call with ``rows`` rows computes with (itself, or the next multiple of 8)."""
    if rows <= 8 or rows % 8 < PAD_FROM_REMAINDER:
        return rows
    return rows + 8 - rows % 8


def small_batch_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, computed as ``(W @ x^T)^T`` when ``x`` holds at most :data:`SMALL_BATCH_ROWS` rows
    (padded to :func:`padded_rows`)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > SMALL_BATCH_ROWS or x.dtype != layer.weight.dtype:
        return F.linear(x, layer.weight, layer.bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = padded_rows(rows)
    if padded != rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    out = torch.mm(layer.weight, flat.t()).t()[:rows]
    if layer.bias is not None:
        out = out + layer.bias
    return out.contiguous().view(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def small_batch_linears(model: nn.Module) -> Iterator[None]:
    """Inside: every plain ``nn.Linear`` of ``model`` on CPU computes through :func:`small_batch_linear`.

    Plain means exactly ``nn.Linear`` (a LoRA layer's ``base_layer`` is one; the LoRA wrapper
    itself is not). Outside, the layers are as before. Does nothing for a model on another device.
    """
    layers = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
              and "forward" not in m.__dict__]
    for layer in layers:
        layer.forward = functools.partial(small_batch_linear, layer)  # instance attribute: shadows the class forward
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
