"""`dspark.launch.slurm`: Slurm's nodelist syntax and how its variables fill `dspark run`'s defaults
(pure logic: no Slurm needed, the environment is a dict)."""

from __future__ import annotations

import pytest

from dspark.launch.slurm import LaunchDefaults, expand_nodelist, launch_defaults, slurm_job
from tests.messages import assert_names

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4", "SLURM_NODEID": "1",
       "SLURM_JOB_NODELIST": "node[01-03,07]", "SLURM_GPUS_ON_NODE": "8", "SLURM_NTASKS_PER_NODE": "1",
       "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "4"}


@pytest.mark.parametrize(("text", "hosts"), [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),              # no padding asked
    ("n[08-10]", ["n08", "n09", "n10"]),           # the lower bound's padding is kept
    ("a[1,3],b", ["a1", "a3", "b"]),
    ("node[1-2].cluster.org", ["node1.cluster.org", "node2.cluster.org"]),
    ("rack[1-2]-gpu[1-2]", ["rack1-gpu1", "rack1-gpu2", "rack2-gpu1", "rack2-gpu2"]),
    (" x[1-2] ", ["x1", "x2"]),
])
def test_nodelists_expand_in_slurm_order(text: str, hosts: list[str]) -> None:
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize(("text", "message"), [
    ("node[1-", "unbalanced brackets"),
    ("node]1[", "unbalanced brackets"),
    ("node[3-1]", "range '3-1' runs backwards"),
    ("node[a-b]", "'a-b' is not a number"),
    ("", "names no host"),
])
def test_bad_nodelists_are_errors_that_quote_them(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        expand_nodelist(text)
    assert repr(text) in str(info.value)


def test_slurm_job_reads_the_variables() -> None:
    assert slurm_job({"PATH": "/bin"}) is None
    job = slurm_job(JOB)
    assert job is not None
    assert (job.nnodes, job.nnodes_var, job.node_rank, job.gpus_on_node) == (4, "SLURM_JOB_NUM_NODES", 1, 8)
    assert job.nodelist == ("node01", "node02", "node03", "node07")
    older = slurm_job({"SLURM_NNODES": "2", "SLURM_NODELIST": "a[1-2]", "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert older is not None
    assert (older.nnodes_var, older.nodelist_var, older.nodelist, older.ntasks_per_node) == (
        "SLURM_NNODES", "SLURM_NODELIST", ("a1", "a2"), 4)
    with pytest.raises(ValueError) as caught:
        slurm_job({**JOB, "SLURM_NODEID": "x"})
    assert_names(str(caught.value), "SLURM_NODEID='x'")


def _fill(environ: dict[str, str], **given: object) -> LaunchDefaults:
    values: dict[str, object] = {"nproc": None, "nnodes": None, "node_rank": None, "master_addr": None,
                                 "rdzv_endpoint": None, **given}
    return launch_defaults(environ=environ, **values)  # type: ignore[arg-type]


def _values(filled: LaunchDefaults) -> tuple[object, ...]:
    return filled.nproc, filled.nnodes, filled.node_rank, filled.master_addr


def test_outside_slurm_the_builtin_defaults() -> None:
    filled = _fill({})
    assert _values(filled) == (None, 1, 0, None) and filled.from_slurm == ()
    assert _values(_fill({}, nproc=2, nnodes=2, node_rank=1, master_addr="h")) == (2, 2, 1, "h")


def test_slurm_fills_everything_unset_and_says_so() -> None:
    filled = _fill(JOB)
    assert _values(filled) == (8, 4, 1, "node01")
    assert filled.from_slurm == ("nnodes=4 (SLURM_JOB_NUM_NODES)", "nproc=8 (SLURM_GPUS_ON_NODE)",
                                 "node_rank=1 (SLURM_NODEID)",
                                 "master_addr=node01 (first host of SLURM_JOB_NODELIST=node[01-03,07])")


@pytest.mark.parametrize(("given", "values", "taken"), [
    ({"nproc": 2}, (2, 4, 1, "node01"), 3),                        # each given value wins alone
    ({"master_addr": "10.0.0.1"}, (8, 4, 1, "10.0.0.1"), 3),
    ({"node_rank": 0}, (8, 4, 0, "node01"), 3),
    ({"nnodes": 2}, (8, 2, 1, "node01"), 3),                       # a subset of the allocation
    ({"nnodes": 1}, (8, 1, 0, None), 1),                           # one node: node 0 on loopback
    ({"rdzv_endpoint": "node01:29400"}, (8, 4, 0, None), 2),       # c10d assigns ranks and the host
    ({"nproc": 2, "nnodes": 4, "node_rank": 3, "master_addr": "x"}, (2, 4, 3, "x"), 0),
])
def test_a_given_value_always_wins(given: dict[str, object], values: tuple[object, ...], taken: int) -> None:
    filled = _fill(JOB, **given)
    assert _values(filled) == values
    assert len(filled.from_slurm) == taken
    for name, value in given.items():  # nothing given is reported as taken from Slurm
        assert not any(item.startswith(f"{name}=") for item in filled.from_slurm), (name, value)


def test_single_node_allocation_takes_no_rank_or_master() -> None:
    filled = _fill({**JOB, "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu7"})
    assert _values(filled) == (8, 1, 0, None)


def test_cpu_nodes_take_nproc_from_tasks_per_node() -> None:
    cpu_job = {k: v for k, v in JOB.items() if k != "SLURM_GPUS_ON_NODE"} | {"SLURM_NTASKS_PER_NODE": "2"}
    cpu_job |= {"SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "4"}  # two dspark runs per node
    with pytest.raises(ValueError, match=r"SLURM_STEP_NUM_TASKS=8.*SLURM_STEP_NUM_NODES=4"):
        _fill(cpu_job)
    cpu_job |= {"SLURM_STEP_NUM_TASKS": "4"}  # srun --ntasks-per-node=1: one launcher per node
    filled = _fill(cpu_job)
    assert filled.nproc == 2 and "nproc=2 (SLURM_NTASKS_PER_NODE)" in filled.from_slurm
    assert _fill({**JOB, "SLURM_GPUS_ON_NODE": "0", "SLURM_NTASKS_PER_NODE": ""}).nproc is None


def test_a_node_id_outside_the_node_count_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"SLURM_NODEID=3.*nnodes=2"):
        _fill({**JOB, "SLURM_NODEID": "3"}, nnodes=2)
