"""IMDB: the source, clean and checked splits, token ids, length-bucketed batches. Imports only `pipeline.core`."""
