"""Assert on the values an error, log or report names, not on how its sentence is worded.

A message may be reworded freely; what a test pins is what the reader needs from it: the value
echoed back (``"'zero4'"``), the numbers, the rank, file and option names, the valid choices.
"""

from __future__ import annotations

import re


def assert_names(text: str, *values: str) -> None:
    """Fail unless ``text`` contains every one of ``values``.

    Example: ``assert_names(str(err), "strategy='zero4'", "'zero3'", "--strategy")``.
    """
    missing = [value for value in values if value not in text]
    assert not missing, f"{missing!r} not named in:\n{text}"


def assert_line_names(text: str, *values: str) -> None:
    """Fail unless one line of ``text`` names all ``values``, in this order.

    For tables and reports, where a number means something only beside its row's name.
    Example: ``assert_line_names(table, "resnet50", "1.88x", "94%")``.
    """
    pattern = ".*".join(re.escape(value) for value in values)
    assert re.search(pattern, text), f"no line names {list(values)!r} in this order:\n{text}"
