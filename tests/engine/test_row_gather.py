"""zero1/zero2's gather of the updated rows: straight into the parameters through shared memory
where a bucket's parameters split evenly, packed elsewhere ([Note: rows gathered in place] in
:mod:`dspark.engine.row_gather`); either way, the same parameters as one process."""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.harness import assert_close, train_engine, train_reference


def _trained_counting_buffers(strategy: str, optimizer: str, precision: str, bucket_mb: float) -> dict[str, Any]:
    """Train ``even_rows`` for 3 steps, counting the pooled buffers the row gathers take."""
    from dspark import comm
    from dspark.engine.grad_bucket import BufferPool
    from dspark.engine.grad_reducer import GradReducer

    taken: list[int] = []
    inside = [False]
    take, gather = BufferPool.take, GradReducer.gather_updated_rows

    def counting_take(self: BufferPool, *args: Any) -> Any:
        if inside[0]:
            taken.append(1)
        return take(self, *args)

    def marked_gather(self: GradReducer) -> None:
        inside[0] = True
        try:
            gather(self)
        finally:
            inside[0] = False

    BufferPool.take, GradReducer.gather_updated_rows = counting_take, marked_gather  # type: ignore[method-assign]
    try:
        got = train_engine("even_rows", strategy, 3, optimizer=optimizer, precision=precision, bucket_mb=bucket_mb)
    finally:
        BufferPool.take, GradReducer.gather_updated_rows = take, gather  # type: ignore[method-assign]
    return {"state": got["state"], "taken": len(taken), "transport": comm.transport()}


@pytest.mark.parametrize(("optimizer", "precision"), [("sgd", "fp32"), ("adamw", "fp32"), ("adamw", "bf16")])
@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_evenly_split_rows_are_gathered_in_place_and_train_like_one_process(pool, strategy: str, optimizer: str,
                                                                            precision: str) -> None:
    want = train_reference("even_rows", 3, optimizer=optimizer, precision=precision)
    rtol = 1e-5 if precision == "fp32" else 1e-3
    # one bucket per parameter (from the second step: the first observes the order in one bucket):
    # the four 8-row tensors land in place, the head's weight and bias (3 rows) and the 0-d scale
    # are packed, a send and a receive buffer each (packed, every bucket: 2 + 2 * 2 * 7)
    for result in pool.run(_trained_counting_buffers, strategy, optimizer, precision, 1e-4):
        assert result["transport"] == "shm"
        assert result["taken"] == 2 + 2 * 2 * 3, result["taken"]
        assert_close(result["state"], want["state"], f"{strategy} {optimizer} {precision}", rtol=rtol)
    # one bucket of every parameter, the padded ones with them: packed, as before
    for result in pool.run(_trained_counting_buffers, strategy, optimizer, precision, 25.0):
        assert result["taken"] == 3 * 2, result["taken"]
        assert_close(result["state"], want["state"], f"{strategy} {optimizer} {precision}, one bucket", rtol=rtol)
