"""Benchmarks: speed, memory and accuracy measurements that print a table and write JSON (never tests)."""
