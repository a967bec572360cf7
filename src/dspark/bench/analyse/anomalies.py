"""The anomaly rules about scaling, memory, the batch and regressions: each looks at one result (and
its 1-device baseline or its previous run) and says, in plain words with the numbers, what is wrong
and the likely cause. The rules about whether a measurement can be trusted at all live in
:mod:`dspark.bench.analyse.trust`.

Every rule is a pure function returning anomaly dicts ``{"kind", "message", <numbers>...}``
(empty when healthy), so each is tested on synthetic results with no process group. Rules read
measured facts only (what the ranks' models received, the bytes they held, the step times), never
the configuration's label: a replication the configuration did not ask for must be found the same
way as one it did. The thresholds are deliberately loose: a false alarm on every run teaches people
to ignore the report, which is how the seed's bug hid.

[Note: activation bytes]
Activation bytes per rank = ``peak_bytes_per_rank - model_state_bytes_per_rank``: what the rank
held at its peak beyond parameters, gradients and optimizer state. With the batch split N ways,
each rank should need about 1/N of the 1-device run's activation bytes, plus, where the strategy
shards parameters or gradients, the rest of them while they are whole during the step (gathered
for forward and backward, or produced by backward before the reduce-scatter): the model state
counts only the shards a rank keeps between steps.

A step on N > 1 ranks also has transients a 1-device step has not: reducing the gradients takes
scratch up to one copy of them (a bucket's receive buffer, a reduce-scatter's all-to-all), which
overlaps what is left of the activations when backward ends. At one or two samples per rank that
overlap can be the peak (``dspark bench --workloads gpt2-cpu --devices 1,2 --global-batch G
--steps 2 --rounds 1`` at G=2 and G=8 shows it: at G=2 each rank holds well above half the
1-device activations, at G=8 no more than its half). So the rule allows the larger of the
tolerance on the share and the share plus one copy of the gradients: as strict as before once
activations outweigh the gradients, and quiet at a sample per rank.
"""

from __future__ import annotations

from typing import Any

from dspark.bench.analyse.noise import NoiseModel
from dspark.bench.measure.peers import PEERS
from dspark.bench.present.formatting import format_mb, format_ms
from dspark.bench.result import BenchResult
from dspark.engine import STRATEGIES, format_audit

__all__ = [
    "ACTIVATION_TOLERANCE",
    "MEMORY_SLACK_BYTES",
    "MODEL_STATE_TOLERANCE",
    "activation_bytes_per_rank",
    "anomaly",
    "audit_lines",
    "devices",
    "gathered_bytes",
    "is_batch_replicated",
    "memory_above_expected",
    "model_state_excess",
    "reduction_scratch_bytes",
    "regression",
    "replicated_batch",
    "wire_bytes",
]

MODEL_STATE_TOLERANCE = 0.05
"""The fraction by which model state may exceed the strategy's formula (uneven shards are padded)."""
ACTIVATION_TOLERANCE = 1.5
"""How many times a 1/N share activations may reach (per-rank fixed buffers do not shrink with the
batch)."""
MEMORY_SLACK_BYTES = 1_000_000
"""Absolute slack on both memory rules, so tiny CPU presets are not flagged for allocator noise."""


def anomaly(kind: str, message: str, **numbers: Any) -> dict[str, Any]:
    """One anomaly: its kind, its message, and the numbers behind it."""
    return {"kind": kind, "message": message, **numbers}


def devices(num_devices: int) -> str:
    """``"1 device"``, ``"2 devices"``."""
    return f"{num_devices} device" + ("" if num_devices == 1 else "s")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks[:-1]) + f" and {ranks[-1]}" if len(ranks) > 1 \
        else str(ranks[0])


def activation_bytes_per_rank(result: BenchResult) -> int:
    """Peak bytes beyond the model state (see [Note: activation bytes]).

    Example::

        activation_bytes_per_rank(result)   # peak_bytes_per_rank - model_state_bytes_per_rank
    """
    return max(0, result.peak_bytes_per_rank - result.model_state_bytes_per_rank)


def _over_share(result: BenchResult) -> list[tuple[int, int]]:
    """(rank, samples) of ranks whose model received more than a 1/N share of the global batch."""
    share = -(-result.global_batch // result.num_devices)  # the larger share of an uneven split
    return [(rank, n) for rank, n in enumerate(result.samples_by_rank) if n > share]


def is_batch_replicated(result: BenchResult) -> bool:
    """True when, by the batch probe's measurements, two ranks' models received the same batch, a
    rank's model received more than its share, or a module inside the model received the same
    batch-derived input on two ranks.

    Example::

        is_batch_replicated(result)   # True for identical_input_ranks=[[0, 1]]
    """
    if result.num_devices <= 1:
        return False
    return bool(result.identical_input_ranks or _over_share(result) or result.replicated_modules)


def audit_lines(result: BenchResult, kind: str) -> list[str]:
    """What ``engine.audit()`` found above its share, for rows of ``kind`` (``"batch"``,
    ``"param"``, ...), in :func:`dspark.engine.format_audit`'s words, on the first rank that found
    any; [] when it found none, or no audit was taken (a PyTorch peer, an older measurement).

    Example::

        audit_lines(result, "batch")   # ["input batch: 2.0x a 1/2 share, replicated on every rank"]
    """
    for rank, audit in enumerate(result.audit_by_rank):
        rows = [row for row in audit.get("above_share", []) if row.get("kind") == kind]
        if rows:
            lines = format_audit(rows, num_ranks=result.num_devices).splitlines()
            return [f"engine.audit() on rank {rank}: {line}" for line in lines]
    return []


def wire_bytes(result: BenchResult) -> tuple[int, bool]:
    """``(wire bytes per step, estimated?)``: measured by DSpark's counters, else a peer's estimate.

    Example::

        wire_bytes(ddp_result)   # (30_000_000, True)
    """
    if result.comm_wire_bytes_per_step is not None:
        return result.comm_wire_bytes_per_step, False
    return result.estimated_comm_wire_bytes_per_step or 0, True


def gathered_bytes(result: BenchResult) -> int:
    """Bytes of sharded parameters and gradients a rank holds whole for part of a step beyond its
    own shards (see [Note: activation bytes]): ``(N - 1)`` shards of each sharded part.

    Example::

        gathered_bytes(zero3_on_2)   # params shard + grads shard: the other rank's halves
    """
    policy = STRATEGIES.get(PEERS.get(result.strategy, result.strategy))
    if policy is None or result.num_devices <= 1:
        return 0
    sharded = [part for part, on in (("params", policy.shard_params),
                                     ("grads", policy.shard_grads)) if on]
    return sum(result.model_state_parts.get(part, [0, 0])[1] for part in sharded) * (
        result.num_devices - 1)


def reduction_scratch_bytes(result: BenchResult) -> int:
    """One whole copy of the gradients a rank reduces, on N > 1 ranks (see [Note: activation
    bytes]); 0 on one device.

    Example::

        reduction_scratch_bytes(replicate_on_2)   # the gradients' bytes
    """
    if result.num_devices <= 1:
        return 0
    policy = STRATEGIES.get(PEERS.get(result.strategy, result.strategy))
    needed = result.model_state_parts.get("grads", [0, 0])[1]
    return needed * (result.num_devices if policy is not None and policy.shard_grads else 1)


def _expected_activation_bytes(result: BenchResult, baseline: BenchResult | None) -> float | None:
    """The activations a rank of ``result`` needs with its batch sharded: the baseline's, scaled by
    the samples one pass runs (a step in micro-batches holds one micro-batch's activations at a
    time: GPT-2 124M's 256 as 8 x 32 on one device and 4 x 32 per rank on two hold the same), plus
    what zero3 keeps gathered."""
    if baseline is None or activation_bytes_per_rank(baseline) <= 0:
        return None
    baseline_pass = baseline.global_batch / max(baseline.micro_batches, 1)
    share = result.global_batch / result.num_devices
    # a replicated batch's own passes say nothing of a sharded one's: at most the baseline's pass
    sharded_pass = (share / max(result.micro_batches, 1) if result.batch_placement == "shard"
                    else min(share, baseline_pass))
    return (activation_bytes_per_rank(baseline) * sharded_pass / baseline_pass
            + gathered_bytes(result))


def model_state_excess(result: BenchResult) -> bool:
    """Whether a rank holds more model state than its strategy's formula allows (with tolerance)."""
    expected = result.model_state_bytes_expected_per_rank
    return expected > 0 and result.model_state_bytes_per_rank > (
        expected * (1 + MODEL_STATE_TOLERANCE) + MEMORY_SLACK_BYTES)


def replicated_batch(result: BenchResult, baseline: BenchResult | None) -> list[dict[str, Any]]:
    """The ranks' models received the same batch, or more than their share of it, or a module
    inside the model received the same batch-derived input on two ranks (the seed's bug), by the
    batch probe's measurements (see :mod:`dspark.bench.measure.batch_probe`).

    Example::

        replicated_batch(two_devices, one_device)
        # "ranks 0 and 1 fed their models the same batch (equal fingerprints) ..."
    """
    if not is_batch_replicated(result):
        return []
    n = result.num_devices
    share = result.global_batch / n
    facts, causes = [], []
    if result.identical_input_ranks:
        pairs = "; ".join(f"ranks {_ranks(pair)}" for pair in result.identical_input_ranks)
        facts.append(f"{pairs} fed their models the same batch (equal fingerprints of every "
                     "input tensor)")
        causes.append("the batch is replicated before it reaches the model, not split: a "
                      "placement of REPLICATE or None, a loader without a per-rank sampler, or "
                      "the same data seed on every rank")
    ranks_by_samples: dict[int, list[int]] = {}
    for rank, samples in _over_share(result):
        ranks_by_samples.setdefault(samples, []).append(rank)
    for samples, ranks in ranks_by_samples.items():
        who = (f"rank {ranks[0]}'s model" if len(ranks) == 1
               else f"the models of ranks {_ranks(ranks)} each")
        facts.append(f"{who} received {samples} samples per step, {samples / share:.1f}x "
                     f"a 1/{n} share of the global batch of {result.global_batch}")
    if _over_share(result) and not result.identical_input_ranks:
        causes.append("a rank takes more than its slice of the global batch")
    if result.replicated_modules:
        more = result.replicated_module_count - len(result.replicated_modules)
        names = ", ".join(repr(name) for name in result.replicated_modules)
        facts.append(f"inside the model, {names}{f' (and {more} more calls)' if more > 0 else ''} "
                     "received the same batch-derived input on two ranks although the model's "
                     "own inputs differed")
        causes.append("the model's code replicates the batch (e.g. gathers every rank's inputs "
                      "and computes on all of them)")
    facts += audit_lines(result, "batch")
    numbers: dict[str, Any] = {"samples_by_rank": list(result.samples_by_rank),
                               "global_batch": result.global_batch, "num_devices": n,
                               "identical_input_ranks": result.identical_input_ranks,
                               "replicated_modules": list(result.replicated_modules)}
    expected = _expected_activation_bytes(result, baseline)
    if expected is not None:
        held = activation_bytes_per_rank(result)
        ratio = held / expected
        facts.append(f"each rank holds {ratio:.1f}x the activation memory a sharded batch needs "
                     f"({format_mb(held)} vs {format_mb(expected)})")
        numbers.update(activation_bytes_per_rank=held,
                       expected_activation_bytes_per_rank=expected, activation_ratio=ratio)
    message = f"{'; '.join(facts)}; likely cause: {'; '.join(causes)}"
    return [anomaly("replicated_batch", message, **numbers)]


_PART_NAMES = {"params": "the parameters", "grads": "the gradients",
               "optimizer": "the optimizer state"}


def _excess_parts(result: BenchResult) -> str:
    """Which model-state parts exceed the formula, e.g. "the gradients (<held> held, <needed>
    needed) held whole where the strategy shards them"."""
    over = [f"{_PART_NAMES.get(part, part)} ({format_mb(held)} held, {format_mb(need)} needed)"
            for part, (held, need) in result.model_state_parts.items()
            if held > need * (1 + MODEL_STATE_TOLERANCE) + MEMORY_SLACK_BYTES / 3]
    if not over:
        return "a tensor is held whole where it should be sharded"
    return (" and ".join(over) + " are held whole, or twice, where the strategy shards them (a "
            "parameter left gathered, a gradient or state kept beside its shard)")


def _with_gathered(result: BenchResult) -> str:
    gathered = gathered_bytes(result)
    return (f" (with {format_mb(gathered)} of sharded parameters and gradients held whole during "
            "the step)" if gathered else "")


def memory_above_expected(result: BenchResult,
                          baseline: BenchResult | None) -> list[dict[str, Any]]:
    """A rank holds more than its strategy needs: (a) model state, found by walking the module and
    the optimizer, above the ZeRO formula, or (b) activations above :data:`ACTIVATION_TOLERANCE`
    times a 1/N share of the 1-device run's although the batch reached the ranks split.

    Example::

        memory_above_expected(zero2_run, one_device)
        # "rank holds <held> of model state, the zero2 strategy needs <needed>: ..."
    """
    found = []
    expected_state = result.model_state_bytes_expected_per_rank
    if model_state_excess(result):
        held = result.model_state_bytes_per_rank
        found.append(anomaly(
            "memory_above_expected",
            f"rank holds {format_mb(held)} of model state, the {result.strategy} strategy needs "
            f"{format_mb(expected_state)} ({held / expected_state:.2f}x): {_excess_parts(result)}",
            memory="model_state", model_state_bytes_per_rank=held,
            model_state_bytes_expected_per_rank=expected_state, ratio=held / expected_state))
    expected_activation = _expected_activation_bytes(result, baseline)
    if (result.num_devices > 1 and expected_activation is not None
            and not is_batch_replicated(result)):  # a replicated batch has its own rule
        held = activation_bytes_per_rank(result)
        limit = max(expected_activation * ACTIVATION_TOLERANCE,
                    expected_activation + reduction_scratch_bytes(result)) + MEMORY_SLACK_BYTES
        if held > limit:
            found.append(anomaly(
                "memory_above_expected",
                f"each rank holds {format_mb(held)} of activations, {held / expected_activation:.1f}x "
                f"the {format_mb(expected_activation)} a 1/{result.num_devices} share of the "
                f"1-device run needs{_with_gathered(result)}, although each rank's model received "
                "its share of the batch: an activation or buffer is likely replicated, or kept "
                "alive across steps",
                memory="activations", activation_bytes_per_rank=held,
                expected_activation_bytes_per_rank=expected_activation,
                ratio=held / expected_activation))
    return found


_PROVENANCE = (("git_commit", "commit"), ("git_dirty", "uncommitted changes"),
               ("dspark_version", "DSpark"), ("torch_version", "PyTorch"),
               ("python_version", "Python"), ("host", "host"), ("device_model", "device"),
               ("backend", "backend"), ("cpu_malloc", "CPU malloc"),
               ("optimizer_kernel", "optimizer kernel"))


def _shown(name: str, result: BenchResult) -> object:
    value = getattr(result, name)
    return value[:12] if name == "git_commit" else value  # git's own abbreviation length


def regression(result: BenchResult, previous: BenchResult | None,
               noise: NoiseModel | None = None) -> list[dict[str, Any]]:
    """Slower than the previous result of the same configuration, beyond the noise band of
    ``noise`` (see [Note: noise rule] in :mod:`dspark.bench.analyse.noise`). Improvements are not anomalies.

    Example::

        regression(new, ledger.previous(new), NoiseModel.from_history(ledger.results()))
    """
    noise = noise or NoiseModel()
    if previous is None or noise.verdict(previous, result) != "slower":
        return []
    rise = result.step_ms / previous.step_ms - 1
    band, source = noise.band_source(previous, result)
    changed = [f"{label} {_shown(name, previous)!r} -> {_shown(name, result)!r}"
               for name, label in _PROVENANCE if getattr(previous, name) != getattr(result, name)]
    cause = ("what changed: " + "; ".join(changed) if changed else
             "nothing recorded changed (same commit, versions and host): likely load on the "
             "machine; re-run to confirm")
    message = (f"step time rose {rise:.1%} since run {previous.run_id} "
               f"({format_ms(result.step_ms)} vs {format_ms(previous.step_ms)}), beyond the "
               f"noise band of {band:.1%} (from {source}); {cause}")
    return [anomaly("regression", message, step_ms=result.step_ms,
                    previous_step_ms=previous.step_ms, previous_run_id=previous.run_id,
                    previous_result_id=previous.result_id,
                    previous_git_commit=previous.git_commit, relative_change=rise,
                    noise_band=band, noise_band_source=source)]
