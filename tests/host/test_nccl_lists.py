"""NCCL's interface-list syntax (NCCL_SOCKET_IFNAME, NCCL_IB_HCA), as pure logic."""

from __future__ import annotations

import pytest

from dspark.host.nccl_lists import parse_nccl_list
from tests.messages import assert_names


@pytest.mark.parametrize(("spec", "name", "selected"), [
    ("eth", "eth0", True),          # prefixes
    ("eth", "eth10", True),
    ("eth,ib", "ib1", True),
    ("eth", "enp1s0", False),
    ("=eth0", "eth0", True),        # exact names
    ("=eth0", "eth01", False),
    ("^docker,lo", "eth0", True),   # exclusions (NCCL's own default list)
    ("^docker,lo", "docker0", False),
    ("^docker,lo", "lo", False),
    ("^=eth0", "eth01", True),      # exact exclusion
    ("^=eth0", "eth0", False),
])
def test_prefix_exact_and_exclude(spec: str, name: str, selected: bool) -> None:
    assert parse_nccl_list(spec).selects(name) is selected


def test_hca_ports() -> None:
    hcas = parse_nccl_list("=mlx5_0:1,mlx5_1")
    assert hcas.entries == (("mlx5_0", 1), ("mlx5_1", None))
    assert hcas.selects("mlx5_0", 1) and not hcas.selects("mlx5_0", 2)
    assert hcas.selects("mlx5_1", 2)  # no port named: every port
    with pytest.raises(ValueError) as caught:
        parse_nccl_list("mlx5_0:x")
    assert_names(str(caught.value), "port 'x'", "'mlx5_0:x'")
