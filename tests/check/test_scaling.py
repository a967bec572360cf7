"""`dspark check` costs time in proportion to the file's size (it was quadratic: every call kept a
copy of every name the scope had bound, 2000 lines took 7.9 s and 8000 lines 77 s)."""

from __future__ import annotations

import ast
import time

import pytest

from dspark.check.placement_rules import check_source
from dspark.check.reaching_values import reaching_values

pytestmark = pytest.mark.serial

# One block of module-level code: guarded names, a loop, a try and the calls the rules read. Every
# block binds new names, so the scope holds ever more of them (what made each call cost more).
_BLOCK = """\
dim_{i} = None
if dim_{i} is None:
    dim_{i} = 0
for row_{i} in rows:
    w_{i} = dspark.distribute_tensor(row_{i}, shard_dim=dim_{i})
try:
    b_{i} = dspark.distribute_batch(batch, shard_dim=dspark.REPLICATE)
except ValueError:
    b_{i} = None
"""


def _source(blocks: int) -> str:
    return "import dspark\n" + "".join(_BLOCK.format(i=i) for i in range(blocks))


def _seconds(source: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        check_source(source, "generated.py")
        best = min(best, time.perf_counter() - start)
    return best


def test_time_grows_linearly_with_the_file() -> None:
    small, large = _source(200), _source(2000)   # about 1,800 and 18,000 lines
    ratio = _seconds(large, 2) / _seconds(small, 3)
    # 10x the lines: about 10x the time when linear, about 100x when quadratic (the old analysis
    # gave 80x for 4x the lines); the bound leaves room for a loaded machine
    assert ratio < 35, f"10x the lines took {ratio:.1f}x the time"


def test_the_findings_of_every_block_are_found() -> None:
    findings = check_source(_source(300), "generated.py")
    codes = {code: sum(f.code == code for f in findings) for code in ("DSP004", "DSP006")}
    assert codes == {"DSP004": 0, "DSP006": 300}, codes   # the guard leaves only 0 for dim_i


def test_a_call_keeps_only_the_names_it_mentions() -> None:
    tree = ast.parse(_source(50))
    call = tree.body[-2].body[0].value         # w_49 = dspark.distribute_tensor(row_49, shard_dim=dim_49)
    seen = reaching_values(tree)[id(call)]
    assert set(seen) == {"dspark", "row_49", "dim_49"}
    assert [ast.unparse(expr) for expr, _line in seen["dim_49"]] == ["0"]
