"""The trainer: config, the compiled step, the loop, data, checkpoints, optimizer, metrics."""
