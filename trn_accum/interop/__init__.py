"""Hugging Face Llama checkpoints in and out of run directories, and `trn-accum eval`."""
