"""`import dspark` pays only for what every process needs: PyTorch's distributed checkpoint (DCP,
1-2 s with the DTensor machinery behind it) is imported when a checkpoint is saved or loaded."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor")


def _loaded_after(code: str) -> list[str]:
    probe = (f"import json, sys\n{code}\n"
             f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                         check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_dspark_leaves_dcp_out() -> None:
    assert _loaded_after("import dspark") == []


def test_a_checkpoint_function_brings_dcp_in() -> None:
    assert _loaded_after("import dspark\nfrom dspark.checkpoint import save_checkpoint") == sorted(HEAVY)
    assert _loaded_after("import dspark\ndspark.checkpoint.load_checkpoint") == sorted(HEAVY)
