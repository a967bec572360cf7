"""Evaluation across ranks (issue 30): on 2 real ranks, 1001 samples in global batches of 64 (the last
one 41: 21 + 20 rows), the predictions gathered with dspark.gather_for_metrics equal one process's, in
order, each sample once, and dspark.reduce_metrics gives one process's mean loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import dspark
from tests.messages import assert_names

NUM_SAMPLES = 1001
GLOBAL_BATCH = 64


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 6, generator=g)
    return TensorDataset(torch.arange(NUM_SAMPLES), x, (x.sum(dim=1) > 0).long())


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(6, 2)


def _evaluate(rank: int | None = None, world_size: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every rank's view of the whole evaluation: ids and logits gathered in order, the mean loss and
    accuracy reduced, and a per-class vector metric reduced."""
    model = _model()
    loader = dspark.DataLoader(_dataset(), global_batch_size=GLOBAL_BATCH, shuffle=True, seed=2,
                               drop_last=False, allow_uneven=True, rank=rank, world_size=world_size)
    ids, logits = [], []
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for index, x, y in loader:
            out = model(x)
            both = dspark.gather_for_metrics({"id": index, "pair": (out, y)})
            ids.append(both["id"])
            logits.append(both["pair"][0])
            loss_sum += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(-1) == y).sum())
            seen += len(y)
    assert loader.batch_info is not None
    metrics = dspark.reduce_metrics({"loss": loss_sum / seen, "acc": correct / seen,
                                     "per_class": torch.tensor([loss_sum, seen]) / seen}, weight=seen)
    equal = dspark.reduce_metrics({"rank": float(dspark.get_world().rank)})  # weight 1 each: the mean
    return torch.cat(ids), torch.cat(logits), metrics, equal


def _one_process() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Plain PyTorch on the loader's world-size-1 batches: no gather, no reduction."""
    model = _model()
    batches = list(dspark.DataLoader(_dataset(), global_batch_size=GLOBAL_BATCH, shuffle=True, seed=2,
                                     drop_last=False, rank=0, world_size=1))
    ids = torch.cat([b[0] for b in batches])
    with torch.no_grad():
        logits = model(torch.cat([b[1] for b in batches]))
    y = torch.cat([b[2] for b in batches])
    loss = F.cross_entropy(logits.double(), y)
    acc = (logits.argmax(-1) == y).double().mean()
    return ids, logits, {"loss": loss, "acc": acc, "per_class": torch.stack([loss, torch.tensor(1.0)])}


def test_gathered_predictions_and_reduced_metrics_equal_one_process(pool) -> None:
    ids, logits, metrics = _one_process()
    assert sorted(ids.tolist()) == list(range(NUM_SAMPLES))
    for got_ids, got_logits, got, equal in pool.run(_evaluate):
        assert torch.equal(got_ids, ids)  # dataset (loader) order, each sample exactly once
        torch.testing.assert_close(got_logits, logits)
        for name in ("loss", "acc", "per_class"):
            torch.testing.assert_close(got[name], metrics[name].double(), rtol=1e-6, atol=1e-7)
        assert equal["rank"].item() == 0.5


def test_at_world_size_one_both_are_identities(single_process) -> None:
    ids, logits, metrics, equal = _evaluate()
    want_ids, want_logits, want = _one_process()
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(metrics["loss"], want["loss"].double(), rtol=1e-6, atol=1e-7)
    assert equal["rank"].item() == 0.0


def _gather_rows(rows: list[int]) -> list[torch.Tensor]:
    n = rows[dspark.get_world().rank]
    start = sum(rows[: dspark.get_world().rank])
    x = torch.arange(start, start + n, dtype=torch.float64).unsqueeze(1).repeat(1, 2)
    return [dspark.gather_for_metrics(x), dspark.gather_for_metrics([x[:, 0].long()])[0]]


def test_a_rank_with_no_rows_gathers_and_is_gathered(pool) -> None:
    for rows in ([3, 0], [0, 2]):
        for whole, ids in pool.run(_gather_rows, rows):
            assert whole.shape == (sum(rows), 2) and whole.dtype == torch.float64
            assert whole[:, 1].tolist() == list(range(sum(rows))) == ids.tolist()


def _weight_zero_nan() -> dict[str, torch.Tensor]:
    rank = dspark.get_world().rank
    return dspark.reduce_metrics({"loss": float("nan") if rank == 1 else 2.5}, weight=0 if rank == 1 else 4)


def test_a_rank_weighing_nothing_cannot_poison_the_mean(pool) -> None:
    assert [m["loss"].item() for m in pool.run(_weight_zero_nan)] == [2.5, 2.5]


def _mismatched(kind: str) -> None:
    rank = dspark.get_world().rank
    if kind == "trailing":
        dspark.gather_for_metrics(torch.zeros(2, 3 + rank))
    elif kind == "scalar":
        dspark.gather_for_metrics(torch.tensor(1.0))
    elif kind == "names":
        dspark.reduce_metrics({"loss" if rank == 0 else "acc": 1.0})
    else:
        dspark.reduce_metrics({"loss": 1.0}, weight=0)


@pytest.mark.parametrize(("kind", "words"), [
    ("trailing", ["rank 0: rows x (3,)", "rank 1: rows x (4,)"]),
    ("scalar", ["scalar tensor", "reduce_metrics"]),
    ("names", ["rank 0: [('loss', ())]", "rank 1: [('acc', ())]"]),
    ("zero", ["weights sum to 0.0 over 2 ranks"]),
])
def test_mismatches_are_errors_naming_each_ranks_value(pool, kind: str, words: list[str]) -> None:
    with pytest.raises(AssertionError) as failed:
        pool.run(_mismatched, kind)
    errors = [line for line in failed.value.args[0].splitlines() if line.startswith("ValueError")]
    assert len(errors) == 2, failed.value.args[0]  # raised on both ranks
    assert all(word in error for word in words for error in errors), errors


def _kept_over_the_pass(skip_padding: bool) -> dict[str, object]:
    """21 samples at 4 on 2 ranks: the last batch is 1 sample, rank 1's a padding copy of it. Each
    batch's ids kept (or only real ones), then gathered and reduced once after the pass."""
    loader = dspark.DataLoader(TensorDataset(torch.arange(21)), global_batch_size=4, shuffle=False,
                               drop_last=False)
    kept = []
    for (ids,) in loader:
        if not (skip_padding and loader.batch_info is not None and loader.batch_info.padding):
            kept.append(ids)
    ids = torch.cat(kept)
    out: dict[str, object] = {}
    for call in ("gather", "reduce"):
        try:
            out[call] = (sorted(dspark.gather_for_metrics(ids).tolist()) if call == "gather" else
                         dspark.reduce_metrics({"mean_id": ids.double().mean()}, weight=len(ids))["mean_id"].item())
        except ValueError as exc:
            out[call] = str(exc)
    return out


def test_rows_kept_over_a_pass_that_ended_on_padding_are_refused(pool) -> None:
    """Gathered once after the pass, the padding copy would count sample 20 twice (22 ids, a mean of
    10.45 instead of 10): refused on both ranks, naming rank 1's 11 rows; kept without the padding,
    they are every sample once (in rank order, not the dataset's: gather per batch for that)."""
    for out in pool.run(_kept_over_the_pass, False):
        assert_names(out["gather"], "rank 1's rows (11)", "loader.batch_info.padding")
        assert_names(out["reduce"], "rank 1's weight (11)", "loader.batch_info.local_size")
    for out in pool.run(_kept_over_the_pass, True):
        assert out == {"gather": list(range(21)), "reduce": 10.0}


class _Labels:
    """Records each collective's label (a timeout's message names it: see dspark.comm.failures)."""

    def __init__(self) -> None:
        self.seen: list[str | None] = []

    def launch(self, kind, label, start):
        self.seen.append(label)
        return start()

    def wait(self, kind, label, wait) -> None:
        wait()

    def where(self) -> None:
        return None


def _labels_of_the_metric_calls() -> list[str | None]:
    from dspark.comm.observer import set_observer

    labels = _Labels()
    previous = set_observer(labels)
    try:
        dspark.reduce_metrics({"loss": torch.tensor(1.0)})
        dspark.gather_for_metrics(torch.ones(2))
    finally:
        set_observer(previous)
    return labels.seen


def test_each_metric_collective_has_a_dspark_label(pool) -> None:
    # a rank that never arrives at an evaluation timed out as "all_gather_object of 8 bytes": no
    # DSpark operation named
    for seen in pool.run(_labels_of_the_metric_calls):
        assert seen and all(label and label.startswith("dspark.") for label in seen), seen
