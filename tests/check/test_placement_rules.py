"""`dspark.check`: each finding code on a fixture, a clean file, and the rules' details."""

from __future__ import annotations

import pytest

from dspark.check.placement_rules import CODES, check_source
from tests.messages import assert_line_names

# One fixture per code: (source, the code it must raise, the 1-based line it must point at).
FIXTURES: dict[str, tuple[str, int]] = {
    "DSP000": ("def broken(:\n", 1),
    "DSP001": ("import dspark\nx = dspark.distribute_tensor(t, shard_dim=None)\n", 2),
    "DSP002": ("from dspark import distribute_tensor\nw = distribute_tensor(weight)\n", 2),
    "DSP003": ("import dspark as ds\n\nb = ds.distribute_batch(batch, shard_dim='0')\n", 3),
    "DSP004": ("import dspark\n\ndef f(t):\n    dim = None\n    return dspark.distribute_tensor(t, dim)\n", 5),
    "DSP005": ("from torch.distributed.tensor import distribute_tensor\n"
               "w = distribute_tensor(weight, mesh)\n", 2),
    "DSP006": ("import dspark\nxs = dspark.distribute_batch(inputs, shard_dim=dspark.REPLICATE)\n", 2),
    "DSP007": ("import dspark\nfrom torch.utils.data import DataLoader\n\n"
               "loader = DataLoader(dataset, batch_size=32, shuffle=True)\n", 4),
}

CLEAN = """\
import dspark
from dspark import REPLICATE, Shard
from torch.distributed.tensor import Replicate, distribute_tensor as dt

def train(weight, batch, mesh, dim=0):
    w = dspark.distribute_tensor(weight, shard_dim=0)
    r = dspark.distribute_tensor(weight, shard_dim=REPLICATE)   # a weight, not a batch
    s = dspark.distribute_tensor(weight, shard_dim=Shard(-1))
    n = dspark.distribute_tensor(weight, dim)
    x, y = dspark.distribute_batch(batch)                       # distribute_batch defaults to 0
    v = dt(weight, mesh, [Replicate()])
    kw = dspark.distribute_tensor(weight, **options)           # unknown: not guessed
    return w, r, s, n, x, y, v, kw
"""


@pytest.mark.parametrize("code", sorted(FIXTURES))
def test_each_code_fires_on_its_fixture(code: str) -> None:
    source, line = FIXTURES[code]
    findings = check_source(source, "f.py")
    assert [(f.code, f.line) for f in findings] == [(code, line)], findings
    assert findings[0].severity == CODES[code][0]
    assert str(findings[0]).startswith(f"f.py:{line}:")


def test_clean_code_has_no_findings() -> None:
    assert check_source(CLEAN, "clean.py") == []


@pytest.mark.parametrize(("source", "codes"), [
    ("dspark.distribute_tensor(t, shard_dim=True)\n", ["DSP003"]),
    ("dspark.distribute_tensor(t, shard_dim=0.0)\n", ["DSP003"]),
    ("dspark.distribute_tensor(t, shard_dim=-1)\n", []),
    ("dspark.Shard(None)\n", ["DSP001"]),
    ("def f(t, dim=None):\n    return dspark.distribute_tensor(t, shard_dim=dim)\n", ["DSP004"]),
    ("dim = None\ndef f(t, dim=0):\n    return dspark.distribute_tensor(t, dim)\n", []),  # another scope
    ("import torch.distributed.tensor as tdt\ntdt.distribute_tensor(t, mesh, placements=None)\n", ["DSP005"]),
    ("from torch.distributed.tensor import distribute_tensor\n"
     "distribute_tensor(x_batch, mesh, [Replicate()])\n", ["DSP006"]),
    ("dspark.distribute_tensor(x, shard_dim=dspark.REPLICATE)\n", ["DSP006"]),
    ("dspark.distribute_tensor(index, shard_dim=dspark.REPLICATE)\n", []),  # 'x' only as a word
    ("distribute_tensor(t, mesh, [Shard(0)])\n", []),   # torch's signature, whatever the import
    ("distribute_tensor(t, mesh, None)\n", ["DSP005"]),
    ("dspark.distribute_tensor(t, shard_dim=None)  # dspark: ignore[DSP001]\n", []),
    ("dspark.distribute_tensor(t, shard_dim=None)  # dspark: ignore\n", []),
    ("dspark.distribute_tensor(t, shard_dim=None)  # dspark: ignore[DSP006]\n", ["DSP001"]),
    ("dspark.distribute_tensor(t, shard_dim=None)  # noqa: DSP001\n", ["DSP001"]),
    # a value that is None or REPLICATE on one path: a conditional, `or`, `.get(key)`, directly or
    # through a variable of the scope (docs/observe.md's find_bug.py is the last but one)
    ("dspark.distribute_tensor(t, shard_dim=0 if fix else None)\n", ["DSP004"]),
    ("dim = None if flat else 0\ndspark.distribute_tensor(t, dim)\n", ["DSP004"]),
    ("dspark.distribute_tensor(t, shard_dim=cfg.get('shard_dim'))\n", ["DSP004"]),
    ("dspark.distribute_tensor(t, shard_dim=cfg.get('shard_dim', 0))\n", []),
    ("dspark.distribute_tensor(t, shard_dim=dim or None)\n", ["DSP004"]),
    ("shard_dim = 0 if fix else dspark.REPLICATE\nx, y = dspark.distribute_batch(b, shard_dim=shard_dim)\n",
     ["DSP006"]),
    ("from dspark import REPLICATE\ndspark.distribute_batch(b, shard_dim=REPLICATE)\n", ["DSP006"]),
    ("dim = 0 if fix else 1\ndspark.distribute_tensor(x, dim)\n", []),
])
def test_rule_details(source: str, codes: list[str]) -> None:
    assert [f.code for f in check_source("import dspark\n" + source)] == codes


@pytest.mark.parametrize(("source", "codes"), [
    # what reaches the call, not every value the name ever holds (these were false errors)
    ("def f(t, dim=None):\n    if dim is None:\n        dim = 0\n    return dspark.distribute_tensor(t, dim)\n", []),
    ("def f(t, dim=None):\n    if dim is None:\n        raise ValueError\n"
     "    return dspark.distribute_tensor(t, dim)\n", []),
    ("def f(t, dim=None):\n    if dim is not None:\n        return dspark.distribute_tensor(t, dim)\n", []),
    ("def f(t, dim=None):\n    dim = dim or 0\n    return dspark.distribute_tensor(t, dim)\n", []),
    ("def f(t, flag):\n    dim = None\n    if flag:\n        dim = 0\n    else:\n        dim = 1\n"
     "    return dspark.distribute_tensor(t, dim)\n", []),
    ("dim = None\ndim = 0\ndspark.distribute_tensor(t, dim)\n", []),
    ("def other():\n    dim = None\ndim = 0\ndspark.distribute_tensor(t, dim)\n", []),   # another scope's
    # ... and None where it does reach
    ("def f(t, flag, dim=None):\n    if flag:\n        dim = 0\n    return dspark.distribute_tensor(t, dim)\n",
     ["DSP004"]),
    ("dim = 0\nfor step in steps:\n    dspark.distribute_tensor(t, dim)\n    dim = None\n", ["DSP004"]),
    ("dim = None\ntry:\n    dim = int(s)\nexcept ValueError:\n    pass\ndspark.distribute_tensor(t, dim)\n",
     ["DSP004"]),
    ("dim = 0\ndim = None\ndspark.distribute_tensor(t, dim)\n", ["DSP004"]),
    ("dim = None\nif dim:\n    dspark.distribute_tensor(t, dim)\ndspark.distribute_tensor(t, dim)\n", ["DSP004"]),
])
def test_values_are_followed_to_the_call(source: str, codes: list[str]) -> None:
    assert [f.code for f in check_source("import dspark\n" + source)] == codes


@pytest.mark.parametrize(("source", "codes"), [
    ("cfg = {'shard_dim': None}\ndspark.distribute_batch(t, **cfg)\n", ["DSP001"]),
    ("dspark.distribute_batch(t, **dict(shard_dim=None))\n", ["DSP001"]),
    ("dspark.distribute_batch(t, **{'allow_uneven': True})\n", []),
    ("dspark.distribute_tensor(t, **{'allow_uneven': True})\n", ["DSP002"]),
    ("dspark.distribute_tensor(t, **opts)\n", []),                          # unknown: not guessed
    ("import functools\nsplit = functools.partial(dspark.distribute_batch, shard_dim=None)\n", ["DSP001"]),
    ("from functools import partial\npartial(dspark.distribute_tensor, shard_dim=dspark.REPLICATE)\n", []),
    ("import functools\nfunctools.partial(dspark.distribute_batch, shard_dim=dspark.REPLICATE)\n", ["DSP006"]),
])
def test_keywords_through_literal_mappings_and_partial(source: str, codes: list[str]) -> None:
    assert [f.code for f in check_source("import dspark\n" + source)] == codes


def test_a_finding_names_the_assignment_that_reaches_the_call() -> None:
    source = "import dspark\n\ndef g():\n    dim = None\n\ndim = None\nx = dspark.distribute_tensor(t, shard_dim=dim)\n"
    (finding,) = check_source(source)
    assert_line_names(finding.message, "'dim'", "None", "line 6")



@pytest.mark.parametrize(("source", "codes"), [
    ("import dspark\nimport torch\ntorch.utils.data.DataLoader(ds, 8)\n", ["DSP007"]),
    ("import dspark.comm\nfrom torch.utils import data\ndata.DataLoader(ds, sampler=None)\n", ["DSP007"]),
    ("from dspark import Engine\nimport torch.utils.data as tud\ntud.DataLoader(ds, 8, False, None, None)\n",
     ["DSP007"]),
    # a sampler or batch sampler, by keyword or by position, or hidden in **kwargs: not flagged
    ("import dspark\nfrom torch.utils.data import DataLoader\nDataLoader(ds, 8, sampler=s)\n", []),
    ("import dspark\nfrom torch.utils.data import DataLoader\nDataLoader(ds, batch_sampler=b)\n", []),
    ("import dspark\nfrom torch.utils.data import DataLoader\nDataLoader(ds, 8, False, s)\n", []),
    ("import dspark\nfrom torch.utils.data import DataLoader\nDataLoader(ds, **options)\n", []),
    # DSpark's own loader, a script without DSpark, a DataLoader of unknown origin: not flagged
    ("import dspark\ndspark.DataLoader(ds, global_batch_size=8)\n", []),
    ("from torch.utils.data import DataLoader\nDataLoader(ds, batch_size=8)\n", []),
    ("import dspark\nDataLoader(ds, batch_size=8)\n", []),
    ("import dspark\nfrom torch.utils.data import DataLoader\n"
     "DataLoader(val, batch_size=8)  # dspark: ignore[DSP007]\n", []),
])
def test_data_loader_without_sampler(source: str, codes: list[str]) -> None:
    findings = check_source(source, "train.py")
    assert [f.code for f in findings] == codes
    if codes:
        assert "dspark.DataLoader(dataset, global_batch_size=" in findings[0].message
