"""The run's configuration: the schema (sections), config files and `--set` overrides, the
config's mesh and batch rules, and the drift rules (what a resumed run may change)."""
