"""Benchmarks: data sets, the run protocol, presets, results, reports and plots."""
