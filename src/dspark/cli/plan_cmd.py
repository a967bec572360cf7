"""``dspark plan``: every strategy's predicted peak memory and step per rank on each device count.

    dspark plan --workload gpt2-cpu --devices 1,2
    dspark plan --model mypkg.models:build --devices 1,2,8,64 --global-batch 256 --precision bf16 \\
                --interconnect roce-200g --json plan.json --plot plan.png
    dspark plan --probe plan.json --model mypkg.models:build --devices 8,64,512 --interconnect nvlink

``--model module:factory`` (imported as from the current directory) or ``path/to/file.py:factory``
names a callable returning ``(model, sample_batch)`` or ``(model, sample_batch, loss_fn)``.
``--probe`` reuses the measurement kept in an earlier ``--json`` (measure on the target device once,
plan anywhere). The thin layer over :func:`dspark.plan`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from dspark.cli.whole_file import write_whole

__all__ = ["add_parser", "parse_bytes", "run"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"24GB"``, ``"512MiB"``, ``"1e9"`` -> bytes.

    Example::

        parse_bytes("1.5GiB")   # 1610612736
    """
    s = text.strip().lower().replace(" ", "")
    digits = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ValueError(f"--memory-budget {text!r}: give a positive size such as 24GB, 512MiB or "
                         f"1e9 (units: {', '.join(u for u in _UNITS if u)})")
    return int(value * _UNITS[unit])


def _budget(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(exc)) from None


def _devices(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--devices {text!r}: give device counts >= 1 separated by commas, e.g. 1,2,8")
    return counts


def _interconnect(text: str) -> str:
    from dspark.planner import get_interconnect

    try:
        get_interconnect(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``dspark plan``."""
    from dspark.models import WORKLOADS
    from dspark.planner import DEVICES, INTERCONNECTS

    parser = subparsers.add_parser(
        "plan", help="predict each strategy's peak memory and step per rank on 1 to N devices",
        description="Measure one short run of the model on this device, then predict for every "
                    "strategy and device count a rank's peak memory (parameters, gradients, optimizer "
                    "state, activations, communication buffers, runtime) and step time (compute, "
                    "exposed communication, optimizer). See docs/plan.md.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workload", metavar="NAME",
                        help=f"a benchmark workload: {', '.join(WORKLOADS)} (the real sizes probe "
                             "on a GPU; elsewhere pass --probe from a plan made on one)")
    source.add_argument("--model", metavar="MODULE:FACTORY",
                        help="a callable returning (model, sample_batch[, loss_fn]): module:factory "
                             "(imported as from the current directory) or path/to/file.py:factory")
    parser.add_argument("--devices", default="1,2,8", type=_devices, help="device counts (default 1,2,8)")
    parser.add_argument("--global-batch", type=int, default=None,
                        help="samples per step over all ranks (default: the workload's, or the sample batch's)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                        help="default: the workload's, else fp32")
    parser.add_argument("--memory-budget", type=_budget, default=None, metavar="BYTES",
                        help="per rank, e.g. 24GB (default: the device's memory less 10%%)")
    parser.add_argument("--interconnect", type=_interconnect, default=None, metavar="NAME",
                        help=f"link profile: {', '.join(sorted(INTERCONNECTS))}, or INSIDE+ACROSS for a "
                             "two-level fabric (nvlink+roce-200g); default: loopback-gloo on a CPU, nvlink "
                             "on a GPU")
    parser.add_argument("--target-device", choices=sorted(DEVICES), default=None, metavar="NAME",
                        help=f"read the probe for another device ({', '.join(sorted(DEVICES))}): compute and "
                             "memory times scaled by datasheet rates, its memory as the budget (docs/plan.md)")
    parser.add_argument("--shard-group-size", type=int, default=None, metavar="S",
                        help="hybrid rows: ranks per shard group (default: the interconnect's node)")
    parser.add_argument("--strategies", default="all", help="comma-separated, or all (default)")
    parser.add_argument("--probe", metavar="PATH", default=None,
                        help="reuse the probe kept in an earlier --json instead of measuring")
    parser.add_argument("--trace", choices=("auto", "measure", "fake"), default="auto",
                        help="how the probe is made: measure steps here, fake (activations traced on "
                             "fake tensors, no time), or auto (fake where a measured step would not fit)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the plan as JSON")
    parser.add_argument("--plot", metavar="PATH", default=None,
                        help="write predicted speedup against devices per strategy (.png/.svg)")
    parser.set_defaults(func=run)


def _load_factory(module_name: str, attr: str) -> Any:
    """``attr`` of a module named as Python imports it (the current directory first, as
    ``python -m`` has it), or of a file ``path/to/models.py``."""
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        if not path.is_file():
            raise ImportError(f"no file {str(path)!r}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {str(path)!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module  # its own imports and pickling find it by name
        spec.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # a console script's path lacks it
        module = importlib.import_module(module_name)
    return getattr(module, attr)


def _from_factory(spec: str) -> tuple[Any, Any, Any]:
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {spec!r}: give module:factory or path/to/file.py:factory, e.g. "
                         "mypkg.models:build")
    try:
        factory = _load_factory(module_name, attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {spec!r}: {exc}") from None
    except Exception as exc:  # the user's module failed as it ran: one line, where (-vv: the traceback)
        raise ValueError(f"--model {spec!r}: importing it raised {_where_raised(exc)}") from exc
    try:
        made = factory()
    except Exception as exc:
        raise ValueError(f"--model {spec!r}: calling {attr}() raised {_where_raised(exc)}") from exc
    if not (isinstance(made, tuple) and len(made) in (2, 3)):
        raise ValueError(f"--model {spec!r} returned {type(made).__name__}; it must return "
                         "(model, sample_batch) or (model, sample_batch, loss_fn)")
    return made[0], made[1], made[2] if len(made) == 3 else None


def _where_raised(exc: BaseException) -> str:
    """``NameError: name 't' is not defined (models.py, line 2)``: the error and its innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}{where}"


_MAX_PROBE_BYTES = 64 * 2**20
"""A probe file (``dspark plan --json``'s) is kilobytes; a bigger one is not one."""


def _read_probe(path: str) -> Any:
    from dspark.planner import Probe

    try:
        size_bytes = os.stat(path).st_size
        if size_bytes > _MAX_PROBE_BYTES:
            raise ValueError(f"it has {size_bytes} bytes, more than the {_MAX_PROBE_BYTES} a probe may have")
        data = json.loads(Path(path).read_bytes())
        return Probe.from_dict(data.get("probe", data) if isinstance(data, dict) else data)
    except OSError as exc:
        raise ValueError(f"--probe {path!r} cannot be read: {exc.strerror or exc}") from None
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise ValueError(f"--probe {path!r} is not a probe written by `dspark plan --json` "
                         f"({type(exc).__name__}: {str(exc)[:200]})") from None


def run(args: argparse.Namespace) -> int:
    """Plan, print the table, write the JSON and the plot when asked."""
    import dspark

    probe = _read_probe(args.probe) if args.probe else None  # before anything is built: fail fast
    if args.plot:
        import dspark.planner.plot  # raises MissingExtraError without matplotlib, before the probe
        if args.trace == "fake" and probe is None:
            raise ValueError(f"--plot {args.plot} draws the predicted speedup, and --trace fake predicts "
                             "memory and no compute time: drop --plot, or probe with --trace measure")
    max_micro_batch = None
    if args.workload:
        from dspark.models import get_workload

        wl = get_workload(args.workload)
        global_batch = args.global_batch or wl.default_global_batch
        precision = args.precision or wl.default_precision
        max_micro_batch = wl.max_micro_batch
        probe_rows = min(global_batch, max_micro_batch or global_batch)
        model = wl.build_model(seed=0, device="meta" if args.probe else "cpu")
        sample = wl.make_batch(probe_rows, seed=0)
        loss_fn: Any = wl.loss
    else:
        model, sample, loss_fn = _from_factory(args.model)
        global_batch, precision = args.global_batch, args.precision or "fp32"
    strategies = "all" if args.strategies == "all" else [s.strip() for s in args.strategies.split(",")]
    if probe is None:  # progress on stderr: the table alone goes to stdout
        sys.stderr.write(f"dspark plan: probing {args.workload or args.model} on one device "
                         f"(trace={args.trace}: a few training steps at two batch sizes)...\n")
        sys.stderr.flush()
    started = time.perf_counter()
    plan = dspark.plan(model, sample, loss_fn, devices=args.devices, strategies=strategies,
                       precision=precision, global_batch=global_batch,
                       memory_budget=args.memory_budget, interconnect=args.interconnect,
                       max_micro_batch=max_micro_batch, probe=probe, trace=args.trace,
                       shard_group_size=args.shard_group_size, target_device=args.target_device)
    if probe is None:
        sys.stderr.write(f"dspark plan: probed in {time.perf_counter() - started:.1f} s\n")
    sys.stdout.write(f"{plan}\n")
    if args.json:
        write_whole(Path(args.json), plan.to_json() + "\n")
    if args.plot:
        from dspark.planner.plot import speedup_figure

        image = io.BytesIO()  # the format from the suffix (.png, .svg, .pdf), written whole like --json
        speedup_figure(plan).savefig(image, format=Path(args.plot).suffix.lstrip(".") or None)
        write_whole(Path(args.plot), image.getvalue())
    return 0
