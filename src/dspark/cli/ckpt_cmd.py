"""``dspark ckpt info CKPT``, ``dspark ckpt verify CKPT`` and ``dspark ckpt export CKPT OUT
[--dtype D]``: a DSpark checkpoint, read offline (no process group, any strategy and world size that
wrote it).

``info`` prints what the checkpoint holds (step, strategy and world size that wrote it, parameter
count and bytes, optimizer, the ``extra`` names, size on disk); ``--json`` the same as JSON.
``export`` writes the model's weights for inference or another framework (see [Note: offline
export] in :mod:`dspark.checkpoint.export`): ``OUT`` ending in ``.safetensors`` is one file, in
``.pt`` a ``torch.save`` of the state dict, anything else a HuggingFace-style directory of
safetensors shards. ``verify`` checks every byte of every file against the checkpoint's manifest
(see [Note: checkpoint integrity] in :mod:`dspark.checkpoint.manifest`): exit code 0 when all match,
1 naming each file that does not (or a checkpoint without a manifest), 2 when there is no checkpoint.

Example::

    dspark ckpt info ckpt/latest
    dspark ckpt verify ckpt/latest
    dspark ckpt export ckpt/latest gpt2-out/ --dtype bf16
    dspark ckpt export ckpt/latest ckpt.pt --extra model_args     # what nanoGPT's sample.py loads
"""

from __future__ import annotations

import argparse
import json

__all__ = ["add_parser", "run_export", "run_info", "run_verify"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``dspark ckpt`` and its subcommands."""
    parser = subparsers.add_parser(
        "ckpt", help="inspect a checkpoint or export its weights (offline)",
        description="Read a DSpark checkpoint without starting any process group: describe it, "
                    "or write its model's weights as safetensors or a .pt file.")
    commands = parser.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    info = commands.add_parser("info", help="what a checkpoint holds",
                               description="Step, strategy and world size that wrote it, parameter "
                                           "count and bytes, optimizer, extra entries, size on disk.")
    info.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (written by engine.save)")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_no_verify(info)
    info.set_defaults(func=run_info)
    verify = commands.add_parser(
        "verify", help="check every file against the checkpoint's manifest",
        description="Hash every byte of every file and compare with manifest.json, written by the save: "
                    "a file copied from another checkpoint, edited or damaged is named. Exit code 0: "
                    "every file is what the save wrote; 1: some file is not (or there is no manifest).")
    verify.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (written by engine.save)")
    verify.add_argument("--json", action="store_true", help="print JSON instead of lines")
    verify.set_defaults(func=run_verify)
    export = commands.add_parser(
        "export", help="write the model's weights (safetensors directory or file, or .pt)",
        description="OUT ending in .safetensors: one file; ending in .pt: torch.save of the state "
                    "dict (every name of model.state_dict(), tied ones sharing a tensor: "
                    "load_state_dict takes it strictly); otherwise a HuggingFace-style directory "
                    "(model.safetensors, or shards + model.safetensors.index.json, and the model's "
                    "config.json when the checkpoint kept one: from_pretrained loads it). Names as in "
                    "model.state_dict(); in safetensors a tied parameter once unless --all-names.")
    export.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (written by engine.save)")
    export.add_argument("out", metavar="OUT", help="output file or directory")
    export.add_argument("--dtype", default=None, help="cast floating-point tensors: fp32, bf16 or fp16")
    export.add_argument("--max-shard-size", default="5GB",
                        help="largest shard of a directory export (default 5GB, as HuggingFace)")
    export.add_argument("--all-names", action="store_true",
                        help="safetensors: write a tied parameter under each of its names (a copy each), "
                             "so that model.load_state_dict(load_file(OUT)) takes it strictly")
    export.add_argument("--extra", action="append", default=[], metavar="NAME",
                        help="a .pt holds {'model': state_dict, NAME: the engine.save(extra=...) entry}, "
                             "as nanoGPT's sample.py reads it (--extra model_args); repeatable")
    _add_no_verify(export)
    export.set_defaults(func=run_export)


def _add_no_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-verify", action="store_true",
                        help="read a checkpoint that has no manifest.json (written before manifests, "
                             "or its manifest lost), its files unchecked; refused without it")


def run_info(args: argparse.Namespace) -> int:
    from dspark.checkpoint.offline import summarize_checkpoint

    summary = summarize_checkpoint(args.checkpoint, verify=not args.no_verify)
    if args.json:
        print(json.dumps(summary.as_dict(), indent=2))
        return 0
    rows = summary.rows()
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from dspark.checkpoint import verify_checkpoint

    report = verify_checkpoint(args.checkpoint)
    if args.json:
        print(json.dumps({"path": report.path, "ok": report.ok, "problems": report.problems,
                          "save_id": report.save_id, "checkpoint": report.summary, "files": report.files,
                          "bytes_checked": report.bytes_checked, "seconds": round(report.seconds, 3),
                          "manifest_sha256": report.manifest_digest}, indent=2))
    elif report.ok:
        summary = report.summary
        print(f"ok: {report.path}: {report.files} files, {report.bytes_checked:,} bytes match the manifest "
              f"({report.seconds:.2f} s); save {report.save_id}, step {summary['step_count']}, "
              f"{summary['strategy']} on {summary['world_size']} rank(s); manifest sha256 "
              f"{report.manifest_digest}")
    else:
        for problem in report.problems[:_SHOWN_PROBLEMS]:
            print(f"FAILED: {problem}")
        if len(report.problems) > _SHOWN_PROBLEMS:
            print(f"FAILED: ... and {len(report.problems) - _SHOWN_PROBLEMS} more problem(s) "
                  f"({len(report.problems)} in all; --json lists every one)")
    return 0 if report.ok else 1


_SHOWN_PROBLEMS = 20
"""Problems ``verify`` prints one per line: a checkpoint with thousands of bad files says so in one more."""


def run_export(args: argparse.Namespace) -> int:
    from dspark.checkpoint.export import DTYPES, export_checkpoint

    dtype = None
    if args.dtype is not None:
        if args.dtype not in DTYPES:
            raise ValueError(f"--dtype {args.dtype!r} is not one of {sorted(DTYPES)}")
        dtype = DTYPES[args.dtype]
    files = export_checkpoint(args.checkpoint, args.out, dtype=dtype, max_shard_size=args.max_shard_size,
                              verify=not args.no_verify, all_names=True if args.all_names else None,
                              extra=args.extra)
    for path in files:
        print(path)
    return 0
