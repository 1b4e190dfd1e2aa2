"""What compiles the trainer's step without training it: the dry-run (`dryrun`), the step-time
model and its search (`perfmodel`, `search`), the choice of k, remat and loss chunk
(`autok`, `autosettings`), and the first-node hardware check (`neuron_check`)."""
