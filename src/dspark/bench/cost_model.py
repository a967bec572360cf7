"""What a data-parallel step should cost on N devices, from the 1-device step and the traffic.

[Note: cost model]
Strong scaling splits the compute: each rank does ``local_batch / global_batch`` of the 1-device
work. Communication is what the ring collectives put on the wire from one rank, over the bus
bandwidth measured on the spot. The model adds the two, i.e. assumes no overlap of gradient
communication with backward: it is the pessimistic end, so a measured step well *above* it means
time goes somewhere the model does not count (stragglers, copies, oversubscribed cores).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepPrediction", "cost_model_step_ms", "predict_step"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepPrediction:
    """A predicted step, split into its two parts."""

    compute_ms: float
    """The 1-device step scaled to this rank's share of the batch."""
    comm_ms: float
    """Wire bytes per step over the bus bandwidth."""

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.comm_ms


def predict_step(*, baseline_step_ms: float, local_batch: int, global_batch: int,
                 comm_wire_bytes_per_step: int, bus_bytes_per_s: float) -> StepPrediction:
    """Predict one rank's step under [Note: cost model].

    ``bus_bytes_per_s`` must be positive whenever there is traffic to send.

    Example::

        predict_step(baseline_step_ms=245.0, local_batch=128, global_batch=256,
                     comm_wire_bytes_per_step=100_000_000, bus_bytes_per_s=10e9)
        # StepPrediction(compute_ms=122.5, comm_ms=10.0)
    """
    if baseline_step_ms <= 0:
        raise ValueError(f"baseline_step_ms={baseline_step_ms!r} must be > 0")
    if local_batch < 1 or global_batch < 1:
        raise ValueError(f"local_batch={local_batch!r} and global_batch={global_batch!r} "
                         "must be >= 1")
    if comm_wire_bytes_per_step < 0:
        raise ValueError(f"comm_wire_bytes_per_step={comm_wire_bytes_per_step!r} must be >= 0")
    if comm_wire_bytes_per_step and bus_bytes_per_s <= 0:
        raise ValueError(f"bus_bytes_per_s={bus_bytes_per_s!r} must be > 0 to time "
                         f"{comm_wire_bytes_per_step} wire bytes")
    comm_ms = comm_wire_bytes_per_step / bus_bytes_per_s * 1e3 if comm_wire_bytes_per_step else 0.0
    return StepPrediction(compute_ms=baseline_step_ms * local_batch / global_batch,
                          comm_ms=comm_ms)


def cost_model_step_ms(*, baseline_step_ms: float, local_batch: int, global_batch: int,
                       comm_wire_bytes_per_step: int, bus_bytes_per_s: float) -> float:
    """The predicted step time in ms (compute share + communication; see :func:`predict_step`).

    Example::

        cost_model_step_ms(baseline_step_ms=245.0, local_batch=128, global_batch=256,
                           comm_wire_bytes_per_step=100_000_000, bus_bytes_per_s=10e9)  # 132.5
    """
    return predict_step(baseline_step_ms=baseline_step_ms, local_batch=local_batch,
                        global_batch=global_batch,
                        comm_wire_bytes_per_step=comm_wire_bytes_per_step,
                        bus_bytes_per_s=bus_bytes_per_s).step_ms
