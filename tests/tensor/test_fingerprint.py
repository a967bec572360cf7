"""Batch fingerprints: pure logic, no process group."""

from __future__ import annotations

import torch

from dspark.tensor.fingerprint import (
    FINGERPRINT_LEN,
    batch_fingerprint,
    batch_leaves,
    identical_ranks,
)


def test_equal_batches_give_equal_fingerprints_and_halves_differ() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 4, 4, generator=g), torch.randint(0, 10, (8,), generator=g)
    whole = batch_fingerprint((x, y))
    assert whole.shape == (FINGERPRINT_LEN,) and whole.dtype == torch.float64
    assert torch.equal(whole, batch_fingerprint((x.clone(), y.clone())))
    first, second = batch_fingerprint((x[:4], y[:4])), batch_fingerprint((x[4:], y[4:]))
    assert identical_ranks([first, second]) == []
    assert identical_ranks([whole, batch_fingerprint((x.clone(), y.clone())), first]) == [(0, 1)]


def test_a_permutation_of_the_same_rows_is_a_different_batch() -> None:
    tokens = torch.arange(64).reshape(8, 8)
    assert not torch.equal(batch_fingerprint(tokens), batch_fingerprint(tokens.flip(0)))


def test_empty_batches_never_match_and_nested_leaves_are_found() -> None:
    empty = batch_fingerprint(torch.empty(0, 3))
    assert identical_ranks([empty, empty.clone()]) == []
    x, m = torch.ones(2, 2), torch.zeros(2, dtype=torch.bool)
    assert [t.shape for t in batch_leaves((x, {"mask": m}, 3))] == [x.shape, m.shape]
    assert batch_fingerprint((x, {"mask": m}))[0] == 2


def test_large_float_batch_has_no_float64_copy_and_is_stable() -> None:
    x = torch.randn(64, 3, 64, 64)
    a, b = batch_fingerprint(x), batch_fingerprint(x)
    assert torch.equal(a, b)
    assert a[1] == x.numel()


def test_a_sampled_fingerprint_tells_copies_from_different_tensors_without_a_pass() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, 12, 12, generator=g).to(memory_format=torch.channels_last)
    sampled = batch_fingerprint(x, whole=False)
    assert torch.equal(sampled, batch_fingerprint(x.clone(), whole=False))  # clone keeps the format
    assert not torch.equal(sampled, batch_fingerprint(x + 1e-3, whole=False))
    assert identical_ranks([sampled, batch_fingerprint(x.flip(0), whole=False)]) == []
    # the sampled statistics are those of the same positions a contiguous copy has
    assert torch.equal(sampled[4:], batch_fingerprint(x.contiguous(), whole=False)[4:])


def test_a_non_contiguous_tensor_is_fingerprinted_like_its_contiguous_copy() -> None:
    x = torch.randn(8, 4, 6, 6).to(memory_format=torch.channels_last)
    a, b = batch_fingerprint(x), batch_fingerprint(x.contiguous())
    assert torch.equal(a[:2], b[:2]) and torch.equal(a[4:], b[4:])  # counts and sample exact
    torch.testing.assert_close(a[2:4], b[2:4], rtol=1e-12, atol=0)  # sums: another order


def test_complex_tensors_are_fingerprinted_whole_and_sampled() -> None:
    z = torch.randn(8, 3, dtype=torch.complex64)
    for whole in (True, False):
        a = batch_fingerprint(z, whole=whole)
        assert torch.equal(a, batch_fingerprint(z.clone(), whole=whole))
        assert not torch.equal(a, batch_fingerprint(z * 1j, whole=whole))


def test_a_missing_value_neither_hides_a_copy_nor_makes_two_batches_alike() -> None:
    """NaN == NaN is False: compared as values, two copies of a batch holding one NaN looked
    different (the seed's bug passed), and every statistic of any batch with a NaN was NaN alike."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4, generator=g)
    x[3, 2] = float("nan")
    other = torch.randn(8, 4, generator=g)
    other[1, 1] = float("nan")
    with_inf = x.clone()
    with_inf[0, 0] = float("inf")
    prints = [batch_fingerprint(x), batch_fingerprint(x.clone()), batch_fingerprint(other),
              batch_fingerprint(with_inf)]
    assert all(torch.isfinite(fp).all() for fp in prints)
    assert identical_ranks(prints) == [(0, 1)]


def test_dataclass_batches_are_looked_into() -> None:
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        y: torch.Tensor
        tag: str = "train"

    x, y = torch.ones(2, 2), torch.zeros(2)
    assert [t.shape for t in batch_leaves(Batch(x, y))] == [x.shape, y.shape]
