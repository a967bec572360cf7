"""The static checker behind ``dspark check``: rules for risky placements read from the source with
``ast`` (the code is never imported), and the reaching-values analysis they follow names with.

Example::

    from dspark.check import check_source
    [f.code for f in check_source("import dspark\ndspark.distribute_tensor(t, shard_dim=None)\n")]
    # ['DSP001']
"""

from dspark.check.driver import check_paths
from dspark.check.placement_rules import CODES, Finding, check_source
from dspark.check.source_files import python_files

__all__ = ["CODES", "Finding", "check_paths", "check_source", "python_files"]
