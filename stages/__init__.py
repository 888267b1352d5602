"""Thin DVC stage entry points: parse argv, load one params section, call `pipeline`."""
