"""Thin DVC stage entry points: parse argv, load and validate the params once (`pipeline.core.stage`), call
`pipeline`."""
