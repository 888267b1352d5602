"""Serving: TorchServe handler, request protocol, client and config."""
