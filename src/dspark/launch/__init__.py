"""``dspark run`` and what it needs: the launcher (PyTorch's ``torch.distributed.run`` underneath),
the supervisor that stops a job's whole process tree, the process tree itself, Slurm's defaults,
the torchrun entry point, and the preemption signal a training loop polls.

Nothing is imported here, so that ``import dspark`` (which needs only
:func:`dspark.launch.preemption.preemption_requested`) does not load the launcher.
"""
