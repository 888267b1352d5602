"""Evaluation: accuracy of every variant, latency benchmarks, the report and its charts. The top layer."""
