"""The shared-memory transport: two ranks simulated by two threads of this process over one mapping
(pure logic, no process group), then the real path through the 2-rank gloo pool."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

import dspark
from dspark import comm
from dspark.comm import shm_setup
from dspark.comm import shm_transport as shm
from dspark.errors import CollectiveError, CollectiveTimeoutError
from tests.messages import assert_line_names, assert_names

pytestmark = pytest.mark.skipif(not shm_setup.shm_wanted(2, 2, "gloo", "cpu"),
                                reason="needs /dev/shm on x86-64")


def _pair(region: int = 1 << 20, timeout_s: float = 20.0) -> list[shm.ShmTransport]:
    path = shm_setup.new_path()
    shm_setup.create_file(path, shm.mapping_bytes(2, region))
    try:
        return [shm.ShmTransport(path, r, 2, region, timeout_s) for r in range(2)]
    finally:
        os.unlink(path)


def _on_both(ranks: list[shm.ShmTransport], program: Callable[[shm.ShmTransport], Any]) -> list[Any]:
    """Run ``program`` for each rank in its own thread (as two processes would), results by rank."""
    results: list[Any] = [None, None]

    def body(r: int) -> None:
        try:
            results[r] = program(ranks[r])
        except BaseException as exc:  # returned, so that the test sees it
            results[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank never finished: the transport hung"
    for t in ranks:
        t.close()
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
@pytest.mark.parametrize("numel", [1, 7, 70_001])   # 70_001 x 4 bytes: pieces of 256 KiB
def test_the_collectives_match_their_definition(dtype: torch.dtype, numel: int) -> None:
    inputs = [(torch.randn(2 * numel, generator=torch.Generator().manual_seed(r)) * 8).to(dtype)
              for r in range(2)]

    def program(t: shm.ShmTransport) -> dict[str, torch.Tensor]:
        mine = inputs[t.rank]
        total = mine.clone()
        gathered = torch.empty(4 * numel, dtype=dtype)
        scattered = torch.empty(numel, dtype=dtype)
        from_1 = mine.clone()
        ops = [t.all_reduce(total, "sum"), t.all_gather(gathered, mine),
               t.reduce_scatter(scattered, mine), t.broadcast(from_1, 1)]
        for op in reversed(ops):  # waited out of order: completed in order all the same
            op.wait()
        return {"sum": total, "gathered": gathered, "scattered": scattered, "from_1": from_1}

    got = _on_both(_pair(), program)
    expected_sum = inputs[0] + inputs[1]
    for r in range(2):
        assert torch.equal(got[r]["sum"], expected_sum)   # every rank the same bits
        assert torch.equal(got[r]["gathered"], torch.cat(inputs))
        assert torch.equal(got[r]["scattered"], expected_sum[r * numel:(r + 1) * numel])
        assert torch.equal(got[r]["from_1"], inputs[1])   # bit for bit: a copy, not a sum


def test_all_gather_parts_lands_each_part_in_its_own_output() -> None:
    """Parts of 1, 5 and 70_000 elements (the last crosses pieces of 64 K elements): each output
    holds every rank's part in rank order."""
    sizes = [1, 5, 70_000, 3]
    parts = [[torch.arange(k, dtype=torch.float32) + 1000 * r + 100 * i for i, k in enumerate(sizes)]
             for r in range(2)]

    def program(t: shm.ShmTransport) -> list[torch.Tensor]:
        outputs = [torch.empty(2 * k) for k in sizes]
        t.all_gather_parts(parts[t.rank], outputs).wait()
        return outputs

    for got in _on_both(_pair(region=1 << 20), program):
        for i, out in enumerate(got):
            assert torch.equal(out, torch.cat([parts[0][i], parts[1][i]])), i


def test_a_gather_of_nothing_is_one_collective_like_any_other() -> None:
    def program(t: shm.ShmTransport) -> list[float]:
        t.all_gather(torch.empty(0), torch.empty(0)).wait()
        t.all_gather_parts([torch.empty(0), torch.empty(0)], [torch.empty(0), torch.empty(0)]).wait()
        after = torch.ones(1)
        t.all_reduce(after, "sum").wait()
        return after.tolist()

    assert _on_both(_pair(), program) == [[2.0], [2.0]]


def test_max_and_min() -> None:
    def program(t: shm.ShmTransport) -> list[list[float]]:
        hi, lo = torch.tensor([1.0, -3.0]) * (t.rank + 1), torch.tensor([1.0, -3.0]) * (t.rank + 1)
        t.all_reduce(hi, "max").wait()
        t.all_reduce(lo, "min").wait()
        return [hi.tolist(), lo.tolist()]

    assert _on_both(_pair(), program) == [[[2.0, -3.0], [1.0, -6.0]]] * 2


def test_more_in_flight_than_the_region_and_the_headers_hold() -> None:
    """300 all-reduces of 40 KB launched before any wait: 12 MB through a 256 KiB region and 128
    headers. A rank out of room completes its own oldest collectives; nothing deadlocks."""
    def program(t: shm.ShmTransport) -> bool:
        tensors = [torch.full((10_000,), float(t.rank + i)) for i in range(300)]
        ops = [t.all_reduce(x, "sum") for x in tensors]
        for op in ops[::-1]:
            op.wait()
        return all(bool(torch.all(x == 2 * i + 1)) for i, x in enumerate(tensors))

    assert _on_both(_pair(region=256 * 1024), program) == [True, True]


def test_different_collectives_are_named_on_both_ranks_and_the_ranks_go_on() -> None:
    def program(t: shm.ShmTransport) -> tuple[str, float]:
        try:
            if t.rank == 0:
                t.all_reduce(torch.ones(6), "sum").wait()
            else:
                t.all_gather(torch.empty(6), torch.ones(3), label="dspark.gather.experts.1").wait()
            message = "no error"
        except CollectiveError as exc:
            message = str(exc)
        after = torch.ones(2)
        t.all_reduce(after, "sum").wait()   # both ranks stepped past it together
        return message, float(after[0])

    (m0, a0), (m1, a1) = _on_both(_pair(), program)
    assert m0.startswith("rank 0: collective #1 "), m0
    assert_line_names(m0, "all_reduce of 6 x torch.float32", "all_gather of 3 x torch.float32",
                      "(dspark.gather.experts.1)", "rank 1")
    assert m1.startswith("rank 1: collective #1 "), m1
    assert_line_names(m1, "all_gather of 3 x torch.float32", "(dspark.gather.experts.1)",
                      "all_reduce of 6 x torch.float32", "rank 0")
    assert_line_names(m0, "same collectives", "same order")
    assert a0 == a1 == 2.0


def test_ranks_whose_regions_went_out_of_step_still_gather_right() -> None:
    """After a mismatched collective of different sizes the ranks' inputs sit at different offsets
    of their regions: the gather reads each rank's copy where it is."""
    def program(t: shm.ShmTransport) -> list[float]:
        try:
            t.all_reduce(torch.ones(100 if t.rank == 0 else 10), "sum").wait()
        except CollectiveError:
            pass
        out = torch.empty(4)
        t.all_gather_parts([torch.full((1,), float(t.rank)), torch.full((1,), 10.0 + t.rank)],
                           [out[:2], out[2:]]).wait()
        return out.tolist()

    assert _on_both(_pair(), program) == [[0.0, 1.0, 10.0, 11.0]] * 2


def test_a_rank_that_never_joins_times_out_with_its_number() -> None:
    def program(t: shm.ShmTransport) -> str:
        if t.rank == 1:
            return "skipped"
        try:
            t.all_reduce(torch.ones(4), "sum").wait()
        except CollectiveTimeoutError as exc:
            return str(exc)
        return "no error"

    got = _on_both(_pair(timeout_s=0.5), program)
    assert_line_names(got[0], "rank 0:", "all_reduce", "16 bytes", "(collective #1)")
    assert_line_names(got[0], "timed out", "0.5 s", "shared memory", "rank(s) 1", "never joined")


def test_the_settings_are_checked() -> None:
    assert not shm_setup.shm_wanted(2, 1, "gloo", "cpu")      # ranks on two machines
    assert not shm_setup.shm_wanted(1, 1, "gloo", "cpu")
    assert not shm_setup.shm_wanted(2, 2, "nccl", "cuda")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(shm.SHM_ENV, "0")
        assert not shm_setup.shm_wanted(2, 2, "gloo", "cpu")
        mp.setenv(shm.SHM_ENV, "sometimes")
        with pytest.raises(ValueError, match="DSPARK_SHM='sometimes': use 1"):
            shm_setup.shm_wanted(2, 2, "gloo", "cpu")
        mp.setenv(shm.SHM_MB_ENV, "0.5")
        with pytest.raises(ValueError, match="at least 1 MiB"):
            shm_setup.region_bytes()
        mp.setenv(shm.SHM_MB_ENV, "lots")
        with pytest.raises(ValueError) as caught:
            shm_setup.region_bytes()
        assert_names(str(caught.value), "'lots'", "MiB")


# -- through the pool: the default group of a real gloo job -----------------------------------------
def _shm_against_gloo() -> dict[str, object]:
    world = dspark.get_world()
    gloo = comm.new_group()   # a side group always runs on gloo
    try:
        torch.manual_seed(world.rank)
        x = torch.randn(3_000_001)   # 12 MB: pieces of 4 MiB
        via_shm, via_gloo = x.clone(), x.clone()
        h = comm.all_reduce(via_shm, async_op=True)
        comm.all_reduce(via_gloo, group=gloo)
        h.wait()
        bf = x[:1001].to(torch.bfloat16)
        g_shm, g_gloo = torch.empty(2002, dtype=torch.bfloat16), torch.empty(2002, dtype=torch.bfloat16)
        comm.all_gather_into_tensor(g_shm, bf)
        comm.all_gather_into_tensor(g_gloo, bf, group=gloo)
        rs_shm, rs_gloo = torch.empty(500), torch.empty(500)
        comm.reduce_scatter_tensor(rs_shm, x[:1000], op="avg")
        comm.reduce_scatter_tensor(rs_gloo, x[:1000], op="avg", group=gloo)
        parts = [x[:3], x[3:1003], x[1003:1004]]
        via = [[torch.empty(2 * p.numel()) for p in parts] for _ in range(2)]
        comm.all_gather_parts(parts, via[0])
        comm.all_gather_parts(parts, via[1], group=gloo)
        b_shm = x[:5000].clone() if world.rank == 0 else torch.zeros(5000)
        b_gloo = b_shm.clone()
        comm.broadcast(b_shm, src=0)
        comm.broadcast(b_gloo, src=0, group=gloo)
        strided = torch.ones(4, 6)[:, ::2]   # not contiguous: gloo's way, the same on every rank
        comm.all_reduce(strided.contiguous())
        shared = shm_setup.active_transport()
        return {"transport": comm.transport(),
                "file_left": shared is not None and os.path.exists(shared.path),
                "sum": torch.equal(via_shm, via_gloo), "gather": torch.equal(g_shm, g_gloo),
                "rs": torch.allclose(rs_shm, rs_gloo, rtol=0, atol=1e-6),
                "parts": all(torch.equal(a, b) for a, b in zip(*via, strict=True)),
                "broadcast": torch.equal(b_shm, b_gloo)}
    finally:
        comm.destroy_group(gloo)


def test_the_pool_runs_through_shared_memory_with_gloos_results(pool) -> None:
    for got in pool.run(_shm_against_gloo):
        assert got == {"transport": "shm", "file_left": False, "sum": True, "gather": True,
                       "rs": True, "parts": True, "broadcast": True}


def test_a_rank_that_exited_stops_the_wait_at_once() -> None:
    """gloo notices a closed connection; shared memory watches the other ranks' processes."""
    import time

    ranks = _pair(timeout_s=60.0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    ranks[0].watch([os.getpid(), gone.pid])
    gone.wait()
    started = time.monotonic()
    with pytest.raises(CollectiveError) as caught:
        ranks[0].all_reduce(torch.ones(4), "sum").wait()
    assert_line_names(str(caught.value), "rank 0:", "all_reduce", "16 bytes", "(collective #1)", "rank(s) 1",
                      "exited")
    assert time.monotonic() - started < 5
    for t in ranks:
        t.close()


_SCRIPT = """
import torch, dspark
from dspark import comm
world = dspark.init()
t = torch.full((3,), float(world.rank + 1))
comm.all_reduce(t)
print(f"rank {world.rank}: {comm.transport()} {t.tolist()}", flush=True)
dspark.shutdown()
"""


def _launch(tmp_path, setting: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "transport.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, shm.SHM_ENV: setting}
    return subprocess.run([sys.executable, "-m", "dspark.cli.main", "run", "--nproc", "2", str(script)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_dspark_shm_0_puts_the_job_on_gloo_and_a_bad_value_is_refused(tmp_path) -> None:
    done = _launch(tmp_path, "0")
    assert done.returncode == 0, done.stderr[-3000:]
    # two ranks' prints share one pipe: found where they are, not line by line
    assert sorted(re.findall(r"rank \d: \w+ \[[^\]]*\]", done.stdout)) == [
        "rank 0: gloo [3.0, 3.0, 3.0]", "rank 1: gloo [3.0, 3.0, 3.0]"], done.stdout
    refused = _launch(tmp_path, "maybe")
    assert refused.returncode != 0
    assert_line_names(refused.stderr + refused.stdout, "DSPARK_SHM='maybe'", "use 1", "default")


def test_a_small_dev_shm_is_left_to_the_data_loaders(monkeypatch) -> None:
    """A container's 64 MB /dev/shm: the mapping would take more than a quarter, so gloo it is."""
    monkeypatch.setattr(shm_setup, "shm_free_bytes", lambda: 64 * 2**20)
    with pytest.warns(RuntimeWarning) as warned:
        assert shm_setup.create_mapping(shm.mapping_bytes(2, 16 * 2**20)) is None
    assert_line_names(str(warned[0].message), "/dev/shm", "64 MiB free", "gloo")
    monkeypatch.setattr(shm_setup, "shm_free_bytes", lambda: 1 << 40)
    path = shm_setup.create_mapping(shm.mapping_bytes(2, 1 << 20))
    assert path is not None and os.path.getsize(path) == shm.mapping_bytes(2, 1 << 20)
    os.unlink(path)


def test_a_label_travels_whole_or_cut_at_48_bytes() -> None:
    """The header's label words: what the peer's error message names."""
    for label in ["", "dspark.bucket3.all_reduce", "dspark.gather.transformer.h.11.attn", "ü" * 30]:
        text = shm.label_text(shm.label_words(label))
        assert text == label.encode()[:48].decode(errors="replace"), (label, text)
