"""Neuron support: platform (detection, env, trn2 figures), preflight (compiled-HLO checks),
kernels (the NKI adapter). Nothing here imports a Neuron package at import time."""
