"""The HLO reader: lexing and parsing compiled module text, the partitioned module a backend
receives, replica groups, and what a compiler fuses and hoists out of loops."""
