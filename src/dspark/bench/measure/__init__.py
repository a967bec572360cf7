"""Taking measurements: the suites (what to measure), the runner (rounds of fresh worker launches),
the worker each rank runs, the engines measured beside DSpark's (PyTorch's and DeepSpeed's), the
interleaved rounds every comparison uses, and the probes a worker takes (batch, memory, model state,
CPU load and precision, provenance).

Nothing is imported here: a worker process imports only the modules it uses."""
