"""What compiles the trainer's step without training it: the dry-run (`dryrun`), the trn2
step-time model and its search (`perfmodel`), and the first-node hardware check
(`neuron_check`, its rows in `node_rows`). Auto k stays in `train/` (the trainer runs it)."""
