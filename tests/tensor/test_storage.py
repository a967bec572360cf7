"""dspark.tensor.storage: the one storage counter (see [Note: storage bytes])."""

from __future__ import annotations

import torch

from dspark.tensor.storage import storage_bytes, storage_key


def test_each_storage_counts_once_whatever_views_it() -> None:
    w = torch.zeros(1000)
    assert storage_bytes([w, w[:10], w.view(10, 100), w[500:]]) == 4000
    assert storage_key(w[3:]) == storage_key(w)
    assert storage_bytes([w, None, torch.ones(10, dtype=torch.float64)]) == 4080


def test_a_shared_seen_set_counts_a_storage_in_the_first_call_only() -> None:
    w, b = torch.zeros(100), torch.zeros(5)
    seen: set[int] = set()
    assert (storage_bytes([w], seen), storage_bytes([w[1:], b], seen), storage_bytes([b], seen)) == (400, 20, 0)


def test_what_holds_no_memory_counts_nothing() -> None:
    freed = torch.zeros(100)
    freed.untyped_storage().resize_(0)  # freed in place, as zero3 and FSDP2 free a parameter
    assert storage_bytes([torch.empty(10, device="meta"), freed, torch.zeros(3, 3).to_sparse()]) == 0
    assert storage_key(freed) is None


def test_a_device_filter_counts_only_that_kind_of_device() -> None:
    assert storage_bytes([torch.zeros(10)], device_type="cuda") == 0
    assert storage_bytes([torch.zeros(10)], device_type="cpu") == 40
