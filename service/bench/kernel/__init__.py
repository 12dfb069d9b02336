"""`bench kernel`: an attention-kernel microbenchmark with a float64 correctness gate."""
