"""The benchmarks (each script runs on its own: ``python benchmarks/bench_*.py [--quick]``).

A package so that the experiments can import its measurement helpers
(``benchmarks._peak_memory``) from the repository root; as a regular package it also
takes precedence there over the top-level ``benchmarks`` package that Opacus installs.
"""
