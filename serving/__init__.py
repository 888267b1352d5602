"""Serving: the TorchServe handler, the MLflow scoring server (its contract middleware, scoring queue and HTTP
protocol), the client and the configs."""
