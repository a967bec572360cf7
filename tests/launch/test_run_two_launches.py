"""A world of 2 started as two separate `dspark run --nnodes 2 --node-rank R` launches, one rank
each, as two nodes would start it: once on loopback (always), and once in two network namespaces
joined by a veth pair, so that each "node" has its own interfaces and the ranks talk over a real
link chosen with GLOO_SOCKET_IFNAME (when this machine lets the test create namespaces)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dspark.host import interfaces
from dspark.launch.launcher import free_port
from tests.launch import two_node_worker as worker

WORKER = Path(worker.__file__).resolve()
LAUNCH_TIMEOUT_S = 120
# Addresses inside private namespaces: they never meet the host's routing table.
NODE_ADDRS = ("10.213.0.1", "10.213.0.2")


def _dspark(*args: str) -> list[str]:
    return [sys.executable, "-m", "dspark.cli.main", *args]


def _node_command(node_rank: int, master_addr: str, master_port: int, out_dir: Path) -> list[str]:
    return _dspark("run", "--nproc", "1", "--nnodes", "2", "--node-rank", str(node_rank),
                   "--master-addr", master_addr, "--master-port", str(master_port),
                   str(WORKER), str(out_dir))


def _run_both(commands: list[list[str]], envs: list[dict[str, str]]) -> None:
    """Start both launches at once (each waits for the other at the rendezvous); fail with their
    output if either fails or hangs."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd, env in zip(commands, envs, strict=True)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    codes = [proc.returncode for proc in procs]
    assert codes == [0, 0], "\n\n".join(f"node {i} exit {c}:\n{o[-3000:]}"
                                        for i, (c, o) in enumerate(zip(codes, outputs, strict=True)))


def _reference_state() -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch on the whole global batch."""
    model = worker.make_model()
    opt = worker.optimizer()(model.parameters())
    for step in range(worker.STEPS):
        x, y = worker.global_batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _check_world(out_dir: Path, *, master_addr: str, ifnames: tuple[str, str]) -> None:
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, seen in enumerate(ranks):
        assert (seen["rank"], seen["world_size"], seen["backend"]) == (rank, 2, "gloo")
        assert (seen["node_rank"], seen["master_addr"]) == (rank, master_addr)
        assert seen["gloo_socket_ifname"] == ifnames[rank]
        assert seen["all_reduce"] == [3.0] * 4  # 1 + 2, summed across the two launches
    assert ranks[0]["state"] == ranks[1]["state"]  # the gathered model is the same on both nodes
    reference = _reference_state()
    for state in (ranks[0]["state"], ranks[0]["hybrid"]["state"]):
        assert state.keys() == reference.keys()
        for name, want in reference.items():
            got = torch.tensor(state[name])
            assert not torch.equal(want, worker.make_model().state_dict()[name])  # it did train
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    for seen in ranks:  # hybrid's groups from the node layout: a shard group per launch of one rank
        assert seen["hybrid"]["shard_group_size"] == 1 and seen["hybrid"]["replica_all_reduce_calls"] > 0


def _loopback_name() -> str:
    return next((i.name for i in interfaces() if i.is_loopback), "lo")


@pytest.mark.slow
def test_two_launches_on_loopback(tmp_path: Path) -> None:
    lo = _loopback_name()
    why = _netns_unavailable_reason() or "namespaces are available: the veth variant runs as well"
    print(f"two `dspark run --nnodes 2` launches on this host, joined over {lo} (127.0.0.1); {why}")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": lo}
    port = free_port()
    _run_both([_node_command(r, "127.0.0.1", port, tmp_path) for r in (0, 1)], [env, env])
    _check_world(tmp_path, master_addr="127.0.0.1", ifnames=(lo, lo))


@dataclass(frozen=True)
class _Nodes:
    namespaces: tuple[str, str]
    veths: tuple[str, str]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)


def _netns_unavailable_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return f"`ip netns add` needs root (running as uid {os.geteuid()})"
    return None


@contextmanager
def _two_nodes() -> Iterator[_Nodes]:
    """Two network namespaces joined by a veth pair, 10.213.0.1 <-> 10.213.0.2; removed on exit.
    Names carry this process's id: other test sessions may run the same test at the same time."""
    tag = f"{os.getpid() % 100000}"
    nodes = _Nodes(namespaces=(f"dspark{tag}n0", f"dspark{tag}n1"), veths=(f"dsp{tag}v0", f"dsp{tag}v1"))
    steps = [("netns", "add", nodes.namespaces[0]), ("netns", "add", nodes.namespaces[1]),
             ("link", "add", nodes.veths[0], "type", "veth", "peer", "name", nodes.veths[1])]
    for ns, veth, addr in zip(nodes.namespaces, nodes.veths, NODE_ADDRS, strict=True):
        steps += [("link", "set", veth, "netns", ns),
                  ("-n", ns, "addr", "add", f"{addr}/24", "dev", veth),
                  ("-n", ns, "link", "set", veth, "up"), ("-n", ns, "link", "set", "lo", "up")]
    try:
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot build two network namespaces here: `ip {' '.join(step)}` "
                            f"failed: {done.stderr.strip()}")
        yield nodes
    finally:
        for ns in nodes.namespaces:  # deleting a namespace deletes the veth end inside it
            _ip("netns", "del", ns)
        _ip("link", "del", nodes.veths[0])  # only there if the move into a namespace failed


@pytest.mark.slow
def test_two_launches_in_two_network_namespaces_over_a_veth(tmp_path: Path) -> None:
    reason = _netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"two-namespace variant skipped ({reason}); the loopback variant ran instead")
    with _two_nodes() as nodes:
        def in_node(node: int, command: list[str]) -> list[str]:
            return ["ip", "netns", "exec", nodes.namespaces[node], *command]

        # What `dspark env` says on node 1 before launch: the route to node 0 is the veth, and
        # without GLOO_SOCKET_IFNAME gloo would bind loopback (the hostname is not an address of
        # this namespace), which a 2-node job must not do.
        bare = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
        env_out = subprocess.run(in_node(1, _dspark("env", "--json", "--nnodes", "2", "--master-addr",
                                                    NODE_ADDRS[0])),
                                 env=bare, capture_output=True, text=True, timeout=60, check=True)
        net = json.loads(env_out.stdout)["network"]
        assert net["master"]["interface"] == nodes.veths[1] and net["master"]["reach"] == "routed"
        assert [i["ipv4"] for i in net["interfaces"] if i["name"] == nodes.veths[1]] == [
            [f"{NODE_ADDRS[1]}/24"]]
        assert net["gloo"]["is_loopback"]
        assert any(f"GLOO_SOCKET_IFNAME={nodes.veths[1]}" in w for w in net["warnings"]), net["warnings"]

        commands = [in_node(r, _node_command(r, NODE_ADDRS[0], 29500, tmp_path)) for r in (0, 1)]
        envs = [{**bare, "GLOO_SOCKET_IFNAME": veth} for veth in nodes.veths]
        _run_both(commands, envs)
    _check_world(tmp_path, master_addr=NODE_ADDRS[0], ifnames=nodes.veths)
