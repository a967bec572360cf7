"""PyTorch's launcher with the script's own arguments kept away from its parser.

``python -m torch.distributed.run [options] train.py ARGS`` parses ARGS too: its parser takes the
script's arguments as a REMAINDER, but before that it classifies every ``--flag`` on the line, so a
script flag that abbreviates one of the launcher's (``--nproc 5``, ``--master 1``, ``--max 3``) stops
the job with "ambiguous option". ``dspark run`` starts::

    python -m dspark.torchrun_entry N <N launcher arguments, the target last> <the script's arguments>

and this module parses only the launcher's N arguments with torchrun's own parser, then hands the
rest to the script untouched, through torchrun's own ``run``.
"""

from __future__ import annotations

import sys

__all__ = ["main", "split_argv"]


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(launcher arguments, script arguments)`` from ``[str(N), *launcher, *script]``.

    Example::

        split_argv(["3", "--nproc-per-node", "2", "train.py", "--nproc", "5"])
        # (['--nproc-per-node', '2', 'train.py'], ['--nproc', '5'])
    """
    if not argv or not argv[0].isdigit() or not 1 <= int(argv[0]) <= len(argv) - 1:
        raise SystemExit(f"usage: python -m dspark.torchrun_entry N LAUNCHER_ARGS... SCRIPT_ARGS... "
                         f"(N: how many launcher arguments, the target last); got {argv[:1]}")
    count = int(argv[0])
    return argv[1:1 + count], argv[1 + count:]


def main(argv: list[str] | None = None) -> None:
    """Run torchrun on ``argv`` (see :func:`split_argv`), as ``python -m torch.distributed.run``."""
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    launcher, script_args = split_argv(sys.argv[1:] if argv is None else argv)
    args = parse_args(launcher)
    if args.training_script_args:
        raise SystemExit(f"dspark.torchrun_entry: the launcher arguments end with the target; found "
                         f"{args.training_script_args} after it")
    args.training_script_args = script_args
    record(run)(args)


if __name__ == "__main__":
    main()
