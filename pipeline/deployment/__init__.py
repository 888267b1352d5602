"""Deployment: the served predictor, the request contract both servers speak, the MLflow pyfunc and the TorchServe
archive. Imports runtimes and `pipeline.selection`, never a builder."""
