"""Reading results: the analysis computed whenever results are read (:mod:`.analysis`), the anomaly
rules and their causes, the noise model, comparisons between runs, the step breakdown, the plan a
result is checked against, and the peer ratios. Pure functions of results: no process, no file."""
