"""``Engine(strategy="auto")``'s choice: plan the model on the current world, pick the fastest
strategy that fits the memory budget, the same on every rank.

[Note: what auto knows] At construction the engine has a model and an optimizer but no batch:
activations and compute cannot be measured yet. What differs between strategies can: model state
(exact), communication buffers (the engine's real sizes) and the communication each strategy
adds, over the link measured here by a short probe of each collective ([Note: the link probe]). So auto plans with activations and
compute left out (the table says so) and ranks the strategies that fit by their communication
and optimizer time; with compute the same for every strategy, that order is the step's order.
Ties (within :data:`TIE_SHARE` of the step, or :data:`TIE_MS`) go to the less sharded strategy:
on a small model the strategies differ by a collective's latency or two, less than the link
probe resolves, and a measured difference that small is noise, not a reason to shard. Rank 0 measures and decides,
and broadcasts its choice, so every rank builds the same engine. For a full plan with
activations and compute, call :func:`dspark.plan` with a sample batch first and pass its
``best().strategy`` and a ``memory_budget`` that leaves room for the activations.
"""

from __future__ import annotations

import logging

from torch import nn

from dspark import comm
from dspark.engine.auto import AutoRequest, set_auto_resolver
from dspark.engine.policy import STRATEGIES
from dspark.plan.cost import row_cost
from dspark.plan.interconnect import Interconnect
from dspark.plan.link_probe import measure_link
from dspark.plan.planner import Plan, PlanRow, default_memory_budget, model_shape
from dspark.plan.probe import Probe, optimizer_state_of

__all__ = ["TIE_MS", "TIE_SHARE", "auto_plan", "choose"]

log = logging.getLogger(__name__)

TIE_SHARE = 0.02
"""Steps within 2% of the fastest count as equal; the less sharded strategy wins the tie."""
TIE_MS = 1.0
"""Steps within a millisecond of the fastest count as equal too: the link probe fits each
collective's latency from a few timings of two sizes, and on a loaded machine those fits move by
fractions of a millisecond, enough to reorder strategies whose whole difference is one latency."""


def auto_plan(model: nn.Module, *, optimizer: object, precision: str, bucket_mb: float,
              num_ranks: int, bus_bytes_per_s: float, backend: str, memory_budget: int,
              link: Interconnect | None = None) -> Plan:
    """Every strategy's row on ``num_ranks`` ranks as auto sees it (see [Note: what auto knows]),
    over ``link`` (:func:`dspark.plan.link_probe.measure_link`'s) or else one all-reduce bandwidth.

    Example::

        auto_plan(model, optimizer=torch.optim.AdamW, precision="fp32", bucket_mb=25.0, num_ranks=2,
                  bus_bytes_per_s=1e9, backend="gloo", memory_budget=8 << 30)
    """
    shape = model_shape(model, optimizer_state_of(optimizer))  # type: ignore[arg-type]
    unit_bytes = [sum(shape.trainable[i][1].itemsize * _numel(shape.trainable[i][0]) for i in unit)
                  for unit in shape.units]
    probe = Probe.from_one_step(device="not measured", batch=1, forward_ms=0.0, backward_ms=0.0,
                                optimizer_ms=0.0, step_bytes=0.0, num_params=len(shape.trainable),
                                unit_bytes=unit_bytes, optimizer_state=shape.optimizer_state)
    gloo = backend == "gloo"
    if link is None:
        link = Interconnect(name="measured", bytes_per_s=bus_bytes_per_s or 1e9,
                            latency_s=50e-6 if gloo else 5e-6, overlaps_compute=not gloo,
                            source="a short all-reduce on this world")
    rows = []
    for strategy in STRATEGIES:
        cost = row_cost(shape=shape, probe=probe, strategy=strategy, num_ranks=num_ranks,
                        micro_batch=1, passes=1, bucket_mb=bucket_mb, link=link)
        peak = (cost.params_bytes + cost.grads_bytes + cost.optimizer_bytes + cost.comm_buffer_bytes)
        fields = {k: getattr(cost, k) for k in cost.__dataclass_fields__}
        rows.append(PlanRow(strategy=strategy, devices=num_ranks, micro_batch=0, passes=1,
                            budget_bytes=memory_budget, fits=peak <= memory_budget, **fields))
    return Plan(rows=tuple(rows), global_batch=0, precision=precision,
                interconnect=f"measured {link.bytes_per_s / 1e9:.2f} GB/s", memory_budget_bytes=memory_budget,
                probe=probe)


def choose(plan: Plan) -> PlanRow:
    """The fastest row that fits, ties (within :data:`TIE_SHARE` or :data:`TIE_MS`) to the less
    sharded; a clear ``ValueError`` when none fits."""
    fastest = plan.best()
    order = list(STRATEGIES)
    limit = max(fastest.step_ms * (1 + TIE_SHARE), fastest.step_ms + TIE_MS) + 1e-9
    ties = [r for r in plan.rows if r.fits and r.step_ms <= limit]
    return min(ties, key=lambda r: order.index(r.strategy))


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def _resolve(request: AutoRequest) -> tuple[str, Plan]:
    world = request.world
    link = measure_link(world, repeats=3) if world.world_size > 1 else None
    bandwidth = link.bytes_per_s if link is not None else 0.0
    budget = request.memory_budget
    if budget is None:
        local = 1 if world.device.type == "cuda" else world.local_world_size
        budget = default_memory_budget(world.device, local_ranks=local)
    # the link is rank 0's on every rank already (measure_link broadcasts it); the budget may
    # differ by host (available memory), so rank 0's is every rank's
    if world.world_size > 1:
        budget = comm.broadcast_object(budget if world.rank == 0 else None)
    plan = auto_plan(request.model, optimizer=request.optimizer, precision=request.precision,
                     bucket_mb=request.bucket_mb, num_ranks=world.world_size,
                     bus_bytes_per_s=bandwidth, backend=world.backend, memory_budget=budget, link=link)
    chosen = choose(plan).strategy
    if world.rank == 0:
        log.info("strategy='auto' chose %s on %d rank(s); activations and compute not measured at "
                 "construction (no batch yet: dspark.plan(model, batch) predicts them)\n%s",
                 chosen, world.world_size, plan)
    return chosen, plan


set_auto_resolver(_resolve)
