"""Models that price a compiled program: step time, memory, collectives (`hlo/` reads it)."""
