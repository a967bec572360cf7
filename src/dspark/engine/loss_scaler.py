"""Dynamic loss scaling for fp16: multiply the loss so small gradients survive fp16, skip the step when
any rank's gradients overflowed, and grow the scale back after a run of good steps."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LossScaler"]


@dataclass(slots=True, kw_only=True)
class LossScaler:
    scale: float = 2.0**16
    """Current multiplier of the loss."""
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    """Good steps in a row before the scale grows."""
    min_scale: float = 1.0
    good_steps: int = 0

    def __post_init__(self) -> None:
        if not self.scale > 0 or self.growth_factor <= 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(f"loss scaler needs scale > 0, growth_factor > 1, 0 < backoff_factor < 1; "
                             f"got scale={self.scale}, growth_factor={self.growth_factor}, "
                             f"backoff_factor={self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval={self.growth_interval} must be >= 1")

    def update(self, *, found_overflow: bool) -> None:
        if found_overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0
