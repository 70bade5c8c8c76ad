"""Decode-time linear layers as (W @ x^T)^T: the same outputs as F.linear, only inside the context."""

import torch
import torch.nn.functional as F
from torch import nn

from teamrl.rollout.small_batch_linear import SMALL_BATCH_ROWS, padded_rows, small_batch_linear, small_batch_linears


def test_equals_f_linear_for_few_and_many_rows_with_and_without_bias():
    gen = torch.Generator().manual_seed(0)
    for bias in (True, False):
        layer = nn.Linear(24, 40, bias=bias)
        for shape in ((1, 24), (3, 1, 24), (SMALL_BATCH_ROWS, 24), (SMALL_BATCH_ROWS + 1, 24), (2, 5, 24),
                      (13, 24), (3, 5, 24), (31, 24), (SMALL_BATCH_ROWS - 1, 24)):
            x = torch.randn(shape, generator=gen)
            got = small_batch_linear(layer, x)
            assert got.shape == (*shape[:-1], 40) and got.is_contiguous()
            assert torch.allclose(got, F.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_context_patches_plain_linears_only_and_restores_them():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(4, 8)
    want = model(x)
    with small_batch_linears(model):
        assert all("forward" in m.__dict__ for m in model if isinstance(m, nn.Linear))
        assert torch.allclose(model(x), want, atol=1e-6)
    assert not any("forward" in m.__dict__ for m in model)


def test_padded_rows_rounds_up_to_a_multiple_of_8_only_from_5_past_one():
    assert [padded_rows(n) for n in (1, 7, 8, 9, 12, 13, 15, 16, 20, 21, 29, 63)] == [1, 7, 8, 9, 12, 16, 16, 16, 20, 24, 32, 64]
