"""Launch: jax.distributed from Slurm / Kubernetes / flags, and the EKS manifests."""
