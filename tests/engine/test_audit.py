"""engine.audit(): every tensor a rank holds against its placement's share, on 2 gloo ranks. A healthy
run holds nothing above its share under every strategy (and the same bytes as the ZeRO formulas
written out by hand); a replicated batch and a zero3 parameter left gathered are named with their
factor. The wording of the summary is checked on rows made by hand."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import dspark
from dspark.engine import above_share, format_audit
from dspark.engine.audit import AUDIT_KINDS
from dspark.engine.engine import engine_parts
from tests.engine import tiny_models as tm
from tests.engine.test_memory_report import by_hand
from tests.messages import assert_line_names

ROW_KEYS = {"name", "kind", "placement", "bytes", "expected_bytes", "factor"}


def _audited(strategy: str, *, shard_dim: Any = 0, gather: str | None = None,
             mid_window: bool = False) -> dict[str, Any]:
    # the batch check would refuse the replicated batch at once; the audit is what is under test
    engine = dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=strategy, bucket_mb=1e-4, batch_check_every=None)
    for step in range(2):
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, step), shard_dim=shard_dim)
        engine.backward(tm.loss_fn("mlp", engine(x), y))
        engine.step()
    if gather is not None:  # a zero3 parameter left whole on purpose, as a bug would leave it
        slot = next(s for s in engine.slots if s.name == gather)
        engine_parts(engine).zero3.gather_slots([slot])
    if mid_window:  # between backward and step: the reduced gradients are held
        x, y = dspark.distribute_batch(tm.batch("mlp", 8, 2), shard_dim=shard_dim)
        engine.backward(tm.loss_fn("mlp", engine(x), y))
    rows = engine.audit()
    out = {"rows": rows, "text": format_audit(rows)}
    engine.close()
    return out


def _total(rows: list[dict[str, Any]], kind: str) -> int:
    return sum(r["bytes"] for r in rows if r["kind"] == kind)


@pytest.mark.parametrize("mid_window", [False, True], ids=["between steps", "after backward"])
def test_a_healthy_run_holds_nothing_above_its_share(pool, strategy: str, mid_window: bool) -> None:
    for rank, result in enumerate(pool.run(_audited, strategy, mid_window=mid_window)):
        rows = result["rows"]
        assert all(set(r) == ROW_KEYS and r["kind"] in AUDIT_KINDS for r in rows)
        assert {r["kind"] for r in rows} == set(AUDIT_KINDS)
        assert above_share(rows) == [], rows
        assert result["text"].startswith("nothing above its share"), result["text"]
        want = by_hand(strategy, rank)  # the ZeRO formulas, written out in test_memory_report
        if not mid_window:
            want["grads"] = 0  # a rank frees its reduced gradients after the step
        assert {"params": _total(rows, "param"), "grads": _total(rows, "grad"),
                "optimizer": _total(rows, "optimizer")} == want, rows
        # every parameter appears once, by its name in the model
        assert sorted(r["name"] for r in rows if r["kind"] == "param") == sorted(
            n for n, _ in tm.make("mlp").named_parameters())
        batch = [r for r in rows if r["kind"] == "batch"]
        assert len(batch) == 1 and batch[0]["placement"] == "Shard(dim=0)"
        x, _ = tm.batch("mlp", 8, 1)
        assert batch[0]["bytes"] == x.numel() * x.element_size() // 2  # this rank's half


def test_a_replicated_batch_is_named_with_its_factor(pool) -> None:
    for result in pool.run(_audited, "zero2", shard_dim=dspark.REPLICATE):
        (row,) = above_share(result["rows"])
        x, _ = tm.batch("mlp", 8, 1)
        assert row["kind"] == "batch" and row["placement"] == "Replicate()"
        assert row["bytes"] == x.numel() * x.element_size()  # the whole batch on every rank
        assert row["factor"] == pytest.approx(2.0)
        assert result["text"].startswith("input batch: "), result["text"]
        assert_line_names(result["text"], "2.0x", "1/2 share", "replicated on every rank")


def test_a_zero3_parameter_left_gathered_is_named(pool) -> None:
    for result in pool.run(_audited, "zero3", gather="layers.2.weight"):
        (row,) = above_share(result["rows"])
        assert row["name"] == "layers.2.weight" and row["placement"] == "Shard(dim=0)"
        # the whole parameter (2 ranks x a padded 4-row chunk of its 7 rows) next to its own chunk
        chunk_bytes = 4 * 7 * 4
        assert row["bytes"] == 2 * chunk_bytes + chunk_bytes and row["expected_bytes"] == chunk_bytes
        assert row["factor"] == pytest.approx(3.0)
        assert result["text"].startswith("parameter layers.2.weight: "), result["text"]
        assert_line_names(result["text"], "3.0x", "1/2 share", "held whole")


def test_one_process_lists_each_gradient_after_backward(single_process) -> None:
    engine = dspark.Engine(tm.make("tied"), optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           strategy="zero2")
    x, y = tm.batch("tied", 4, 0)
    engine.backward(tm.loss_fn("tied", engine(x), y))
    rows = engine.audit()
    grads = {r["name"] for r in rows if r["kind"] == "grad"}
    # the tied weight is one tensor, listed once; "unused" never gets a gradient
    assert grads == {f"gradient of {n}" for n, p in engine.module.named_parameters()
                     if not n.startswith("unused")}
    assert above_share(rows) == []
    engine.close()


def _row(kind: str, placement: str, factor: float, name: str = "w") -> dict[str, Any]:
    return {"name": name, "kind": kind, "placement": placement, "bytes": int(100 * factor),
            "expected_bytes": 100, "factor": factor}


def test_the_summary_words_each_case() -> None:
    rows = [_row("param", "Replicate()", 1.0), _row("batch", "Replicate() on ranks 0, 2", 2.0, "input batch"),
            _row("grad", "Shard(dim=0)", 4.0, "gradient of fc.weight"),
            _row("optimizer", "Replicate()", 1.5, "fc.bias"), _row("param", "Shard(dim=0)", 1.04)]
    assert format_audit(rows, num_ranks=4).splitlines() == [
        "input batch: 2.0x a 1/4 share, identical on ranks 0, 2",
        "gradient of fc.weight: 4.0x a 1/4 share, a whole gradient held where the strategy keeps a shard",
        "optimizer state of fc.bias: 1.5x one whole copy, more storage than the tensor needs",
    ]
    assert_line_names(format_audit(rows[:1], num_ranks=4), "nothing above its share", "1 tensor checked")
    assert above_share(rows, tolerance=1.0) == rows[1:]


def test_the_recorded_batch_keeps_no_autograd_graph_and_is_fingerprinted_when_read() -> None:
    from dspark.engine.inputs import ForwardInputs
    from dspark.tensor.fingerprint import batch_fingerprint

    x = torch.randn(4, 3, requires_grad=True) * 2  # a non-leaf input: holding it would hold a graph
    record = ForwardInputs.of([x])
    assert record.nbytes == 4 * 3 * 4
    assert all(t.grad_fn is None and not t.requires_grad for t in record.leaves)
    before = batch_fingerprint([x])
    with torch.no_grad():
        x.add_(1.0)  # the data changes after the forward: the record read nothing yet
    assert not torch.equal(record.fingerprint(), before)
    assert torch.equal(record.fingerprint(), batch_fingerprint([x]))
