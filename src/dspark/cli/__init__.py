"""The ``dspark`` command line; the entry point is :func:`dspark.cli.main.main`.

Nothing is imported here, so that ``python -m dspark.cli.main`` runs without a double import.
"""

__all__: list[str] = []
