"""dspark.plan on a small model, in one process (the probe runs on this CPU)."""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dspark
from dspark.planner import Plan, get_interconnect, model_shape
from dspark.planner.cost import buckets, state_bytes
from dspark.planner.table import needed_bytes
from dspark.policy.state_bytes import expected_state_bytes
from dspark.policy.strategies import STRATEGIES
from tests.messages import assert_names


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _batch(rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 32, generator=g), torch.randint(0, 10, (rows,), generator=g)


@pytest.fixture(scope="module")
def small_plan() -> Plan:
    return dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[1, 2, 4])


def test_rows_cover_every_strategy_and_count_and_the_caller_model_is_untouched(small_plan: Plan) -> None:
    assert {(r.strategy, r.devices) for r in small_plan.rows} == {
        (s, n) for s in STRATEGIES for n in (1, 2, 4)}
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    dspark.plan(model, _batch(), F.cross_entropy, devices=[1], strategies=["replicate"])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_model_state_is_the_engine_formula(small_plan: Plan) -> None:
    params = list(_mlp().parameters())
    for row in small_plan.rows:
        want = expected_state_bytes(params, STRATEGIES[row.strategy], rank=0, num_ranks=row.devices,
                                    optimizer_state=(2, True))
        assert (row.params_bytes, row.grads_bytes, row.optimizer_bytes) == (
            want["params"], want["grads"], want["optimizer"]), row
    one = small_plan.row("replicate", 1)
    assert one.model_state_bytes == 16 * sum(p.numel() for p in params) + 4 * len(params)


def test_the_batch_splits_and_sharding_shrinks_the_state(small_plan: Plan) -> None:
    assert [small_plan.row("replicate", n).micro_batch for n in (1, 2, 4)] == [16, 8, 4]
    two = {s: small_plan.row(s, 2) for s in STRATEGIES}
    assert two["zero3"].model_state_bytes < two["zero2"].model_state_bytes \
        < two["zero1"].model_state_bytes < two["replicate"].model_state_bytes
    assert small_plan.row("replicate", 1).comm_exposed_ms == 0.0
    assert two["replicate"].comm_exposed_ms > 0.0
    fixed, whole = small_plan.probe.optimizer_fixed_ms, small_plan.probe.optimizer_ms
    assert 0.0 <= fixed <= whole
    # both reduce whole gradients: the same pass over them before the step (cost.gradient_check_ms)
    check = small_plan.row("replicate", 2).optimizer_ms - whole
    assert check > 0.0
    assert small_plan.row("zero1", 2).optimizer_ms == pytest.approx(fixed + (whole - fixed) / 2 + check)


def test_a_budget_picks_the_micro_batch_and_best_the_fastest_fitting_row() -> None:
    free = dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[2])
    replicate = free.row("replicate", 2)
    tight = dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[2], probe=free.probe,
                        memory_budget=needed_bytes(replicate) - 1)
    assert not tight.row("replicate", 2).fits or tight.row("replicate", 2).micro_batch < 8
    assert tight.best(devices=2).peak_bytes < replicate.peak_bytes
    assert free.best(devices=2) is min((r for r in free.rows if r.fits), key=lambda r: r.step_ms)
    none = dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[2], probe=free.probe, memory_budget=1)
    with pytest.raises(ValueError, match="no strategy fits on 2"):
        none.best()


def test_plan_prints_a_table_and_round_trips_to_json(small_plan: Plan) -> None:
    text = str(small_plan)
    assert "zero3" in text and "peak MB" in text and "fits" in text
    data = small_plan.to_dict()
    assert len(data["rows"]) == 12 and data["rows"][0]["peak_bytes"] == small_plan.rows[0].peak_bytes


def test_bad_input_names_the_value() -> None:
    with pytest.raises(ValueError, match="strategies='zero4'"):
        dspark.plan(_mlp(), _batch(), F.cross_entropy, strategies="zero4")
    with pytest.raises(ValueError, match="16 % 3"):
        dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[3])
    with pytest.raises(ValueError, match="interconnect='x'"):
        dspark.plan(_mlp(), _batch(), F.cross_entropy, interconnect="x")


def test_a_meta_model_is_planned_from_a_materialised_copy() -> None:
    with torch.device("meta"):
        model = _mlp()
    plan = dspark.plan(model, _batch(), F.cross_entropy, devices=[1, 2], strategies="zero3")
    assert plan.row("zero3", 2).params_bytes > 0
    assert all(p.is_meta for p in model.parameters())


def test_buckets_group_in_ready_order_by_size() -> None:
    shape = model_shape(_mlp(), (2, True))
    ready = [0.9, 0.9, 0.5, 0.5, 0.1, 0.1]  # backward reaches the last layer first
    one = buckets(shape, ready, bucket_mb=25.0)
    assert len(one) == 1 and one[0][0] == 0.9
    small = buckets(shape, ready, bucket_mb=256 * 256 * 4 / 2**20)  # the middle weight alone
    assert [r for r, _ in small] == sorted(r for r, _ in small) and len(small) >= 2
    assert state_bytes(shape, "zero3", 2)["params"] < state_bytes(shape, "replicate", 2)["params"]


def test_a_slow_link_costs_more() -> None:
    fast = dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[2], interconnect="nvlink")
    slow = dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[2], probe=fast.probe,
                       interconnect=get_interconnect("loopback-gloo"))
    assert slow.row("replicate", 2).comm_exposed_ms > fast.row("replicate", 2).comm_exposed_ms


def test_sgd_without_momentum_plans_no_optimizer_state() -> None:
    plan = dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[1],
                       optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    assert plan.row("replicate", 1).optimizer_bytes == 0


def test_a_model_whose_state_does_not_fit_the_probe_device_is_refused_with_the_numbers(monkeypatch) -> None:
    from dspark.planner import table

    monkeypatch.setattr(table, "default_memory_budget", lambda device, local_ranks=1: 1000)
    state_mb = f"{16 * sum(p.numel() for p in _mlp().parameters()) / 1e6 + 0.0:,.1f} MB"
    with pytest.raises(ValueError, match=f"state \\({state_mb}\\) exceeds the 0.0 MB"):
        dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[1], trace="measure")
    fake = dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[1])  # auto: traced, not refused
    assert fake.probe.device == "fake:cpu" and fake.row("replicate", 1).activation_bytes > 0


def _meta_tower() -> nn.Module:
    with torch.device("meta"):  # ~34 MB of parameters, never allocated
        return nn.Sequential(*(layer for _ in range(8) for layer in (nn.Linear(1024, 1024), nn.GELU())))


def test_a_meta_model_whose_activations_exceed_the_budget_is_planned_by_its_fake_trace(monkeypatch) -> None:
    from dspark.planner import table

    batch = (torch.zeros(4096, 1024), torch.zeros(4096, 1024))
    monkeypatch.setattr(table, "default_memory_budget", lambda device, local_ranks=1: 200_000_000)
    plan = dspark.plan(_meta_tower(), batch, F.mse_loss, devices=[1, 2])
    assert plan.probe.device == "fake:cpu" and "fake trace" in str(plan)
    # saved for backward, each 4096 x 1024 fp32: the input, 8 Linear outputs (GELU inputs), 8 GELU
    # outputs (the next Linear's or the loss's input), the loss's target; + 1 for the gradient
    # backward allocates beside them (see [Note: the fake trace])
    assert plan.probe.step_bytes.at(4096) == pytest.approx(19 * 4096 * 1024 * 4, rel=0.02)
    one = plan.row("replicate", 1)
    assert one.fits and one.micro_batch < 4096 and one.passes == 4096 // one.micro_batch  # micro-batches
    assert f"grad_accum_steps={one.passes}" in str(plan) and f"x.split({one.micro_batch})" in str(plan)
    with pytest.raises(ValueError, match="trace='x'"):
        dspark.plan(_meta_tower(), batch, F.mse_loss, devices=[1], trace="x")


def test_the_fake_trace_is_within_15_percent_of_the_measured_activations() -> None:
    from dspark.planner.fake_trace import fake_activation_bytes

    precision = "fp32"  # not bf16 on so narrow a model: see [Note: the fake trace]
    measured = dspark.plan(_mlp(), _batch(256), F.cross_entropy, devices=[1], precision=precision,
                           trace="measure").probe
    for rows in (64, 256):
        fake = fake_activation_bytes(_mlp(), _batch(256), loss_fn=F.cross_entropy, precision=precision,
                                     device=torch.device("cpu"), rows=rows)
        # per sample: the fixed part (scratch, bf16 weight copies) is not an activation
        assert fake / (measured.step_bytes.at(rows)) <= 1.15, (rows, fake, measured)
    fake_line = dspark.plan(_mlp(), _batch(256), F.cross_entropy, devices=[1], precision=precision,
                            trace="fake").probe.step_bytes
    assert fake_line.per_sample == pytest.approx(measured.step_bytes.per_sample, rel=0.15)


def test_a_plan_from_a_fake_trace_has_no_speedup_to_plot() -> None:
    # its rows' steps are the communication alone: the speedup divided by a zero step (a
    # ZeroDivisionError), or drew the communication's where every row had some
    pytest.importorskip("matplotlib")
    from dspark.planner.plot import speedup_figure

    plan = dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[1, 2], trace="fake")
    with pytest.raises(ValueError) as refused:
        speedup_figure(plan)
    assert_names(str(refused.value), "'fake:cpu'", "--trace measure")


def test_a_plan_from_a_fake_trace_prints_no_speedup() -> None:
    # its 1-device step is 0 ms (no compute timed): every row with communication printed "0.00x"
    plan = dspark.plan(_mlp(), _batch(), F.cross_entropy, devices=[1, 2], strategies="replicate", trace="fake")
    text = str(plan)
    assert plan.row("replicate", 2).step_ms > 0 and "0.00x" not in text
    two = next(line for line in text.splitlines() if line.startswith("replicate") and line.split()[1] == "2")
    assert two.split()[-2] == "-", two
    assert_names(text, "a fake trace times no compute", "--trace measure")


class _PartlyFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(100, 16)
        self.first = nn.Linear(16, 16)
        self.middle = nn.Linear(16, 16)
        self.last = nn.Linear(16, 4)
        for p in (*self.embed.parameters(), *self.middle.parameters()):
            p.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(self.middle(self.first(self.embed(tokens)))))


def test_the_probe_finds_the_frozen_parameters_backward_never_reads() -> None:
    from dspark.planner.probe import measure_probe

    batch = (torch.randint(0, 100, (8, 5), generator=torch.Generator().manual_seed(0)), torch.arange(8) % 4)
    probe = measure_probe(_PartlyFrozen(), batch, loss_fn=F.cross_entropy,
                          optimizer=functools.partial(torch.optim.SGD, lr=0.1), precision="fp32",
                          device=torch.device("cpu"), batches=(2, 8), units=[""], library_baseline=False)
    # frozen, in order: embed.weight, middle.weight, middle.bias; the middle layer's input needs a
    # gradient, so backward reads its weight, never its bias nor the embedding
    assert probe.frozen_unread == (0, 2)
    from dspark.cpu_malloc import tune_for_training

    # a fresh buffer past the mmap threshold: its pages faulted in; where this process kept glibc's
    # own moving threshold (set once per process, by whichever test came first), a freed buffer
    # raises it and the next one is served from the heap: nothing faults
    if tune_for_training().mode != "default":
        assert probe.fault_bytes_per_s > 0


def test_the_probe_times_the_step_under_the_engines_malloc(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the engine fixes glibc's thresholds before its first step; a probe timed under glibc's
    own moving ones paid page faults at the larger batch that the engine's step does not."""
    import dspark.planner.probe as probe_module
    from dspark.cpu_malloc import tune_for_training

    calls: list[str] = []
    monkeypatch.setattr(probe_module, "tune_for_training", lambda: calls.append("tuned") or tune_for_training())
    batch = (torch.randint(0, 100, (4, 5), generator=torch.Generator().manual_seed(0)), torch.arange(4) % 4)
    probe = probe_module.measure_probe(_PartlyFrozen(), batch, loss_fn=F.cross_entropy,
                                       optimizer=functools.partial(torch.optim.SGD, lr=0.1), precision="fp32",
                                       device=torch.device("cpu"), batches=(2, 4), units=[""], steps=1,
                                       library_baseline=False)
    assert calls == ["tuned"]
    assert probe.check_bytes_per_s > 0  # the engine's scale-and-check pass over the gradients, measured
    assert probe.per_copy_s > 0  # [Note: per-copy cost]: one small copy into a flat buffer's view, measured


def test_the_fault_probe_holds_one_buffer_just_past_the_mmap_threshold() -> None:
    """The probe runs in the rank that will train, under its memory_budget: measuring the page-fault
    rate must not hold more than one buffer of a little past the size the C library maps apart."""
    from dspark.bench.measure.memory import peak_rss_bytes, reset_peak_rss
    from dspark.cpu_malloc import mmap_threshold_bytes
    from dspark.planner.probe import FAULT_PROBE_MARGIN_BYTES, measure_fault_bytes_per_s

    if not reset_peak_rss():
        pytest.skip("this system cannot reset the peak resident memory")
    before = peak_rss_bytes()
    assert measure_fault_bytes_per_s(torch.device("cpu")) >= 0.0
    buffer_bytes = mmap_threshold_bytes() + FAULT_PROBE_MARGIN_BYTES
    assert peak_rss_bytes() - before < 1.5 * buffer_bytes


_SEEN: list[tuple[float, float]] = []
"""At each forward of a :class:`_SeesItsWeights`: the norm of its weight, and what float32 arithmetic
made of a denormal (the probe trains a copy of the model: a list of the module's own would not reach
the test)."""


class _SeesItsWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SEEN.append((float(self.linear.weight.norm()), (torch.tensor([1e-39], dtype=torch.float32) * 1.0).item()))
        return self.linear(x)


def test_each_timing_round_starts_from_the_same_weights_and_computes_on_denormals_as_the_engine() -> None:
    """A model that memorises the probe's one batch slows down on denormal floats the run never
    meets: each round starts from the same weights instead (see [Note: each round starts from the
    same weights]), and the probe's arithmetic keeps the denormals a real step meets, as the
    engine's does (flushing them made every model's probe fast)."""
    from dspark.planner.probe import measure_probe
    from dspark.planner.probe_timing import MIN_ROUNDS

    _SEEN.clear()
    measure_probe(_SeesItsWeights(), (torch.randn(8, 4), torch.arange(8) % 2), loss_fn=F.cross_entropy,
                  optimizer=functools.partial(torch.optim.SGD, lr=0.1), precision="fp32",
                  device=torch.device("cpu"), batches=(2, 8), units=[""], library_baseline=False)
    weights = collections.Counter(w for w, _ in _SEEN)
    assert max(weights.values()) >= MIN_ROUNDS, weights  # SGD moves them every step: one value per round start
    assert all(seen != 0.0 for _, seen in _SEEN)
