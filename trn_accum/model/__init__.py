"""Models. `fuji` is the LLaMA-style Fuji decoder family (AXLearn), in plain JAX."""
