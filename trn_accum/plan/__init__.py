"""What compiles the trainer's step without training it: the dry-run (`dryrun`), the step-time
model and its mesh search (`perfmodel`, `search`), the one search that chooses every setting a
config leaves "auto" (`settings`, `resolution`, `settings_run`), and the first-node hardware
check (`neuron_check`)."""
