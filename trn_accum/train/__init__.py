"""The trainer: the compiled step, the loop, optimizer, metrics, stop rules, preemption."""
