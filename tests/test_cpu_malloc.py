"""dspark.cpu_malloc: when DSpark's engine sets glibc's malloc thresholds, and that a step's tensors
then come from the heap (kept between steps) instead of fresh mappings."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from dspark import cpu_malloc
from tests.messages import assert_names

glibc_linux = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                 reason="glibc's malloc on Linux only")


@pytest.mark.parametrize(("env", "reason"), [
    ({"DSPARK_CPU_MALLOC": "default"}, "DSPARK_CPU_MALLOC=default"),
    ({"DSPARK_CPU_MALLOC": " Default "}, "DSPARK_CPU_MALLOC=default"),
    ({"DSPARK_CPU_MALLOC": "heap", "LD_PRELOAD": "libmimalloc.so"}, "mimalloc preloaded"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc preloaded"),
    ({"LD_PRELOAD": "libtcmalloc_minimal.so.4"}, "tcmalloc preloaded"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES sets malloc"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_ is set"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_ is set"),
])
@glibc_linux
def test_the_user_s_own_malloc_setting_is_left_alone(env: dict[str, str], reason: str) -> None:
    assert cpu_malloc._reason_to_leave(env) == reason


@glibc_linux
def test_nothing_set_means_dspark_sets_it() -> None:
    assert cpu_malloc._reason_to_leave({}) is None
    assert cpu_malloc._reason_to_leave({"DSPARK_CPU_MALLOC": "tuned",
                                        "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}) is None


def test_an_unknown_choice_names_the_valid_ones() -> None:
    with pytest.raises(ValueError) as caught:
        cpu_malloc.tune_for_training({"DSPARK_CPU_MALLOC": "fast"})
    assert_names(str(caught.value), "DSPARK_CPU_MALLOC='fast'", "tuned", "heap", "lean", "default")


def test_describe() -> None:
    assert cpu_malloc.CpuMalloc("tuned").describe() == "dspark"
    assert cpu_malloc.CpuMalloc("heap").describe() == "dspark heap"
    assert cpu_malloc.CpuMalloc("lean").describe() == "dspark lean"
    assert cpu_malloc.CpuMalloc("default", "not glibc").describe() == "default (not glibc)"


_PROBE = """
import functools, json, torch
import dspark
from dspark import cpu_malloc

def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            return tuple(int(x, 16) for x in line.split()[0].split("-"))
    return (0, 0)

world = dspark.init()
assert cpu_malloc.current() is None  # init alone leaves malloc as it is: the engine sets it
engine = dspark.Engine(torch.nn.Linear(4, 4), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
in_heap = {}
# below lean's 1 MiB; below and above glibc's largest moving mmap threshold (32 MiB)
for kib in (512, 16 * 1024, 64 * 1024):
    t = torch.empty(kib * 2**8)  # float32: kib KiB
    lo, hi = heap()
    in_heap[kib] = lo <= t.data_ptr() < hi
    del t
print(json.dumps({"state": cpu_malloc.current().describe(), "in_heap": in_heap}))
"""


def _probe(env_value: str | None) -> dict[str, object]:
    import os

    env = {k: v for k, v in os.environ.items()
           if k not in ("DSPARK_CPU_MALLOC", "GLIBC_TUNABLES", "LD_PRELOAD", "MALLOC_TRIM_THRESHOLD_",
                        "MALLOC_MMAP_THRESHOLD_") and not k.startswith(("RANK", "WORLD_SIZE"))}
    if env_value is not None:
        env["DSPARK_CPU_MALLOC"] = env_value
    done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
@glibc_linux
def test_the_engine_serves_a_step_s_tensors_from_the_heap() -> None:
    """A fresh process's first 16 MiB tensor: glibc maps it on its own (its threshold starts at
    128 KiB and only moves once a mapping is freed); once an Engine exists it comes from the heap,
    where a later step reuses it without page faults. 64 MiB stays a mapping unless ``heap``;
    ``lean`` maps everything from 1 MiB up and keeps only smaller requests in the heap."""
    assert _probe(None) == {"state": "dspark", "in_heap": {"512": True, "16384": True, "65536": False}}
    assert _probe("heap") == {"state": "dspark heap", "in_heap": {"512": True, "16384": True, "65536": True}}
    assert _probe("lean") == {"state": "dspark lean", "in_heap": {"512": True, "16384": False, "65536": False}}
    untouched = _probe("default")  # 512 KiB: wherever glibc's moving threshold has got to
    assert untouched["state"] == "default (DSPARK_CPU_MALLOC=default)"
    in_heap = untouched["in_heap"]
    assert isinstance(in_heap, dict)
    assert {k: v for k, v in in_heap.items() if k != "512"} == {"16384": False, "65536": False}


def test_the_engine_refuses_an_unknown_choice(single_process: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    import torch

    import dspark

    monkeypatch.setenv("DSPARK_CPU_MALLOC", "off")
    with pytest.raises(ValueError, match="DSPARK_CPU_MALLOC='off'"):
        dspark.Engine(torch.nn.Linear(2, 2), optimizer=functools.partial(torch.optim.SGD, lr=0.1))


@pytest.mark.parametrize(("state", "trims"), [(None, False), (cpu_malloc.CpuMalloc("default", "x"), False),
                                              (cpu_malloc.CpuMalloc("tuned"), True)])
def test_release_freed_trims_only_where_dspark_set_the_thresholds(monkeypatch: pytest.MonkeyPatch,
                                                                  state: object, trims: bool) -> None:
    calls: list[int] = []

    class Libc:
        def malloc_trim(self, pad: int) -> int:
            calls.append(pad)
            return 1

    monkeypatch.setattr(cpu_malloc, "_state", state)
    monkeypatch.setattr(cpu_malloc, "_libc", lambda: Libc())
    cpu_malloc.release_freed()
    assert calls == ([0] if trims else [])


def vm_flags(address: int) -> list[str]:
    """The kernel's flags of the mapping that holds ``address`` (/proc/self/smaps' ``VmFlags``)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize(("state", "kib", "advised"), [
    (cpu_malloc.CpuMalloc("tuned"), 64 * 1024, True),  # mapped apart: faulted in afresh every time
    (cpu_malloc.CpuMalloc("tuned"), 16 * 1024, False),  # in the heap: kept between steps
    (cpu_malloc.CpuMalloc("lean"), 64 * 1024, True),
    (cpu_malloc.CpuMalloc("heap"), 64 * 1024, False),
    (cpu_malloc.CpuMalloc("default", "x"), 64 * 1024, False),
    (None, 64 * 1024, False),
])
@glibc_linux
def test_a_storage_mapped_apart_is_advised_to_huge_pages(monkeypatch: pytest.MonkeyPatch, state: object,
                                                         kib: int, advised: bool) -> None:
    """[Note: huge pages for mapped storages]: the kernel marks the mapping (``hg``), before any page
    of it is touched; a tensor in the heap, or where DSpark did not set the thresholds, is left alone."""
    import torch

    monkeypatch.setattr(cpu_malloc, "_state", state)
    t = torch.empty(kib * 2**8)  # float32: kib KiB, never touched
    assert cpu_malloc.advise_huge_pages(t.data_ptr(), kib * 2**10) is advised
    if kib >= 64 * 1024:  # mapped apart whatever glibc's threshold (it moves up to 32 MiB only)
        assert ("hg" in vm_flags(t.data_ptr() + kib * 2**9)) is advised  # its middle: the ends are partial pages
