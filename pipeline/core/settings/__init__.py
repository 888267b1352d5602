"""The settings schema: one pydantic dataclass per `params.yaml` section, the closed sets of allowed values, the
cross-section rules and the `auto` resolution. `pipeline.core.params` is the public entry point."""
