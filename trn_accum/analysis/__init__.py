"""Analysis of compiled programs: the HLO parser, and the accum-steps search."""
