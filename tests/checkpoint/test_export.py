"""`dspark ckpt export | info` and `read_extra`: a checkpoint written by 2 zero3 ranks read offline
(no process group) equals the engine's full_state_dict(); 0-d parameters keep their shape."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dspark
import dspark.checkpoint
from dspark.checkpoint.export import export_checkpoint
from dspark.checkpoint.hf_files import SafetensorsSource, parse_size, plan_shards, shard_file_names
from dspark.cli.main import main
from tests.checkpoint.ranks import train
from tests.engine import tiny_models as tm
from tests.messages import assert_names

MODEL_ARGS = {"n_layer": 2, "dropout": 0.0, "name": "tiny", "sizes": [3, 4]}


def _save(path: str, name: str, strategy: str) -> dict[str, torch.Tensor]:
    engine = dspark.Engine(tm.make(name), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy=strategy)
    train(engine, name, range(1))
    engine.save(path, extra={"model_args": dict(MODEL_ARGS), "ema": {"w": torch.arange(4.0)}})
    state = engine.full_state_dict()
    engine.close()
    return state


@pytest.fixture(scope="module")
def saved(pool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    out = {}
    for name in ("mlp", "tied"):
        path = tmp_path_factory.mktemp("export") / f"ckpt-{name}"
        states = pool.run(_save, str(path), name, "zero3")
        out[name] = (path, states[0])
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) <= set(want)
    for key, value in got.items():
        assert value.shape == want[key].shape, key
        assert torch.equal(value, want[key]), key


def test_a_safetensors_file_equals_full_state_dict_and_keeps_0d_shapes(saved: Any, tmp_path: Path) -> None:
    path, full = saved["mlp"]
    files = export_checkpoint(path, tmp_path / "m.safetensors")
    assert files == [tmp_path / "m.safetensors"]
    source = SafetensorsSource(files[0])
    got = {name: source.read(name) for name in source.headers}
    assert set(got) == set(full)
    assert got["scale"].shape == ()
    _assert_same(got, full)


def test_a_tied_weight_once_in_safetensors_and_under_every_name_in_a_pt(saved: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path, full = saved["tied"]
    once = load_file(export_checkpoint(path, tmp_path / "t.safetensors")[0])
    assert "embed.weight" in once and "head.weight" not in once  # as HuggingFace stores it
    _assert_same(once, full)
    for got in (torch.load(export_checkpoint(path, tmp_path / "t.pt")[0], weights_only=True),
                load_file(export_checkpoint(path, tmp_path / "all.safetensors", all_names=True)[0])):
        assert set(got) == set(full)  # every name of model.state_dict(), the tied one too
        _assert_same(got, full)
        model = tm.make("tied")
        model.load_state_dict(got)  # strict
        assert torch.equal(model.head.weight, full["head.weight"])


def test_a_directory_is_sharded_with_an_index(saved: Any, tmp_path: Path) -> None:
    path, full = saved["mlp"]
    files = export_checkpoint(path, tmp_path / "hf", max_shard_size=100, dtype=torch.bfloat16)
    assert len(files) > 1
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(full)
    source = SafetensorsSource(tmp_path / "hf")
    for name, value in full.items():
        assert source.read(name).dtype == torch.bfloat16
        assert torch.equal(source.read(name), value.to(torch.bfloat16)), name


def test_export_refuses_to_overwrite(saved: Any, tmp_path: Path) -> None:
    (tmp_path / "m.pt").write_text("x")
    with pytest.raises(FileExistsError, match=r"m\.pt"):
        export_checkpoint(saved["mlp"][0], tmp_path / "m.pt")


def test_export_into_a_checkpoint_or_below_it_is_refused(saved: Any) -> None:
    path, _ = saved["mlp"]
    before = sorted(p.name for p in path.iterdir())
    for out in (path, path / "hf", path / "m.safetensors", path / "sub" / "m.pt"):
        with pytest.raises(ValueError) as refused:
            export_checkpoint(path, out)
        assert_names(str(refused.value), repr(str(out)), repr(str(path.parent / f"{path.name}-")[:-1]))
    assert sorted(p.name for p in path.iterdir()) == before  # nothing written into it


def _write_inside(path: str, beside: str) -> list[tuple[str, str]]:
    """Every way an engine writes into a checkpoint or below it, and engine.save onto an export."""
    engine = dspark.Engine(tm.make("mlp"), optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
                           strategy="zero3")
    engine.save_pretrained(beside)   # an export's directory, for the last case
    out = []
    for write in (lambda: engine.save_pretrained(path), lambda: engine.save_pretrained(f"{path}/hf"),
                  lambda: engine.save(f"{path}/inner"), lambda: engine.save(beside)):
        try:
            write()
            out.append(("accepted", ""))
        except Exception as exc:
            out.append((type(exc).__name__, str(exc)))
    engine.load(path, optimizer=False)   # the checkpoint is as it was
    engine.close()
    return out


def test_an_engine_refuses_to_write_inside_a_checkpoint_on_every_rank(pool, saved: Any, tmp_path: Path) -> None:
    path, _ = saved["mlp"]
    beside = tmp_path / "exported"
    before = sorted(p.name for p in path.iterdir())
    for rank, results in enumerate(pool.run(_write_inside, str(path), str(beside))):
        for (kind, message), inside in zip(results[:3], (path, path / "hf", path / "inner"), strict=True):
            # rank 0 checks the path; another rank learns of it in the agreement that follows
            assert kind in (("ValueError",) if rank == 0 else ("ValueError", "OtherRankError")), message
            assert_names(message, repr(str(inside)), "checkpoint")
        kind, message = results[3]   # the reverse: a checkpoint onto an export's directory
        assert kind == "ValueError", message
        assert_names(message, repr(str(beside)), "not a DSpark checkpoint")
    assert sorted(p.name for p in path.iterdir()) == before


def test_read_extra_before_anything_is_built(saved: Any) -> None:
    path, _ = saved["mlp"]
    assert dspark.checkpoint.read_extra(path, "model_args") == MODEL_ARGS
    assert torch.equal(dspark.checkpoint.read_extra(path, "ema")["w"], torch.arange(4.0))
    with pytest.raises(KeyError, match=r"'nope'.*\['ema', 'model_args'\]"):
        dspark.checkpoint.read_extra(path, "nope")


def test_cli_info_and_export_from_another_directory(saved: Any, tmp_path: Path) -> None:
    path, full = saved["mlp"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = functools.partial(subprocess.run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    info = run([sys.executable, "-m", "dspark.cli.main", "ckpt", "info", str(path), "--json"])
    assert info.returncode == 0, info.stderr
    described = json.loads(info.stdout)
    assert described["world_size"] == 2 and described["strategy"] == "zero3" and described["step"] == 1
    assert described["num_params"] == sum(v.numel() for v in full.values())
    assert described["param_bytes"] == 4 * described["num_params"]
    assert described["extra"] == ["ema", "model_args"] and described["optimizer"] == "AdamW"
    assert described["disk_bytes"] > described["param_bytes"]
    export = run([sys.executable, "-m", "dspark.cli.main", "ckpt", "export", str(path), "out.safetensors",
                  "--dtype", "fp16"])
    assert export.returncode == 0, export.stderr
    source = SafetensorsSource(tmp_path / "out.safetensors")
    assert source.read("scale").shape == () and source.read("scale").dtype == torch.float16
    bad = run([sys.executable, "-m", "dspark.cli.main", "ckpt", "export", str(path), "o.pt", "--dtype", "int8"])
    assert bad.returncode == 2 and "'int8'" in bad.stderr


def test_cli_info_table(saved: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ckpt", "info", str(saved["tied"][0])]) == 0
    out = capsys.readouterr().out
    assert "zero3 on 2 rank(s)" in out and "model_args" in out


def test_cli_no_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ckpt", "info", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_shard_plan_and_sizes() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size(7) == 7
    with pytest.raises(ValueError, match="'5 parsecs'"):
        parse_size("5 parsecs")
    assert plan_shards([("a", 6), ("b", 6), ("c", 20), ("d", 1)], max_shard_bytes=12) == [["a", "b"], ["c"], ["d"]]
    assert shard_file_names(1) == ["model.safetensors"]
    assert shard_file_names(2)[1] == "model-00002-of-00002.safetensors"
