"""The bottom layer: settings (`params`), file I/O, machine facts, MLflow tracking, run ids, stage plumbing and the
user-error base class. Imports nothing else of the project."""
