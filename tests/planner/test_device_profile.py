"""Devices as well as links ([Note: device profiles]): a probe read for another device, on made-up
probes (no process group, no model run)."""

from __future__ import annotations

import pytest
import torch

import dspark
from dspark.planner import DEVICES, DeviceProfile, Probe, get_device_profile
from dspark.planner.device_profile import profile_of, scale_probe
from tests.messages import assert_names

H200 = "NVIDIA H200 (kept artifact)"


def _probe(device: str = H200) -> Probe:
    return Probe.from_one_step(device=device, batch=8, forward_ms=10.0, backward_ms=20.0, optimizer_ms=4.0,
                               step_bytes=1e6, num_params=4, unit_bytes=[0, 1, 1])


def test_compute_scales_by_the_flops_ratio_and_the_optimizer_by_the_bandwidth_ratio() -> None:
    h200, gb10 = get_device_profile("h200"), get_device_profile("gb10")
    probe = scale_probe(_probe(), h200, gb10)
    compute = h200.compute_flops_per_s / gb10.compute_flops_per_s
    memory = h200.memory_bytes_per_s / gb10.memory_bytes_per_s
    assert probe.forward_ms.at(8) == pytest.approx(10.0 * compute)
    assert probe.backward_ms.at(8) == pytest.approx(20.0 * compute)
    assert probe.optimizer_ms == pytest.approx(4.0 * memory)
    assert probe.step_bytes == _probe().step_bytes and probe.process_baseline_bytes == 0
    assert probe.device.startswith(gb10.name) and H200 in probe.device


def test_the_probes_device_finds_its_profile_or_is_refused_by_name() -> None:
    assert profile_of(H200) is DEVICES["h200"]
    assert profile_of("cpu").compute_flops_per_s > 0  # measured here
    with pytest.raises(ValueError) as caught:
        profile_of("mps:0")
    assert_names(str(caught.value), "mps:0", "h100", "gb10")
    with pytest.raises(ValueError) as caught:
        DeviceProfile(name="x", compute_flops_per_s=0.0, memory_bytes_per_s=1.0, memory_bytes=1, source="-")
    assert_names(str(caught.value), "x", "compute_flops_per_s")


def test_a_plan_for_two_dgx_sparks_says_so_and_takes_the_sparks_compute() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    batch = (torch.randn(8, 64), torch.randint(0, 8, (8,)))
    loss = torch.nn.functional.cross_entropy
    here = dspark.plan(model, batch, loss, devices=[2], strategies="replicate", probe=_probe(),
                       interconnect="roce-200g").row("replicate", 2)
    spark = dspark.plan(model, batch, loss, devices=[2], strategies="replicate", probe=_probe(),
                        interconnect="roce-200g", target_device="gb10")
    ratio = DEVICES["h200"].compute_flops_per_s / DEVICES["gb10"].compute_flops_per_s
    assert spark.row("replicate", 2).compute_ms == pytest.approx(here.compute_ms * ratio)
    assert spark.row("replicate", 2).peak_bytes == here.peak_bytes
    assert "NVIDIA GB10 (DGX Spark), scaled from NVIDIA H200" in str(spark)
