"""Training data: prepare-data (read, encode, progress), prepared token files and corpora,
the datasets a run draws its batches from."""
