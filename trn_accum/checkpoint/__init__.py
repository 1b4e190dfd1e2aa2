"""Checkpoints and the run directory: orbax save and restore, the run dir's owner and its
liveness, and the read-only readers that other commands use beside a live run."""
