"""Benchmarking: datasets, interleaved timing, method runners and reports."""
