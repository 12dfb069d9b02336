"""Offline engine benchmarks: the engine against transformers on the same weights, in one process."""
