"""`dspark.launch.devices`: the node's devices read without torch, and `--nproc` held to them."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark.launch.devices import LocalDevices, check_fits, local_devices
from tests.messages import assert_names


def _driver(tmp_path: Path, gpus: int) -> Path:
    for i in range(gpus):
        (tmp_path / "gpus" / f"0000:0{i}:00.0").mkdir(parents=True)
    return tmp_path / "gpus"


@pytest.mark.parametrize(("visible", "gpus"), [
    (None, 4), ("0,1", 2), ("3", 1), ("", 0), ("-1", 0), ("0,-1,2", 1), ("0,1,2,3,4,5", 4)])
def test_visible_gpus(tmp_path: Path, visible: str | None, gpus: int) -> None:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert local_devices(environ, _driver(tmp_path, 4)).gpus == gpus


def test_no_driver_no_gpus(tmp_path: Path) -> None:
    found = local_devices({}, tmp_path / "absent")
    assert found.gpus == 0 and found.cores >= 1


def test_more_workers_than_devices_names_both_numbers_and_the_fix() -> None:
    with pytest.raises(ValueError) as caught:
        check_fits(5, oversubscribe=False, devices=LocalDevices(gpus=0, cores=2))
    assert_names(str(caught.value), "nproc=5", "2 CPU core(s)", "nproc=2 or fewer", "oversubscribe=True")
    with pytest.raises(ValueError) as caught:
        check_fits(9, oversubscribe=False, devices=LocalDevices(gpus=8, cores=4))
    assert_names(str(caught.value), "nproc=9", "8 GPU(s)", "4 CPU core(s)", "nproc=8 or fewer")
    assert check_fits(5, oversubscribe=True, devices=LocalDevices(gpus=0, cores=2)) is None
    assert check_fits(2, oversubscribe=False, devices=LocalDevices(gpus=0, cores=2)) is None
    assert check_fits(8, oversubscribe=False, devices=LocalDevices(gpus=8, cores=4)) is None


def test_more_workers_than_gpus_is_a_warning_that_they_run_on_cpu() -> None:
    warning = check_fits(2, oversubscribe=False, devices=LocalDevices(gpus=1, cores=16))
    assert warning is not None and "1 visible GPU(s)" in warning and "nproc=1" in warning
