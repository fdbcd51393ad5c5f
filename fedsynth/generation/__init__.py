"""The generator's clients: fetching class-conditional images from one generator service or several replicas, and the
metric names both sides share. Imports `wire`, `process`, `config`, `config_schema`, `errors` and `v1`."""
