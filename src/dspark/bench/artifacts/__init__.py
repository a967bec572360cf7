"""Kept measurements: the table a benchmark script writes (:mod:`.table`), an artifact under
``benchmarks/results/`` verified against its pinned chain head (:mod:`.kept`), and every kept result
checked against its own steps (:mod:`.consistency`). ``python -m dspark.bench.record`` keeps one and
``python -m dspark.bench.figures`` renders them."""
