"""What every fedsynth process shares: its lifetime (signals, parent binding), atomic writes and JSON helpers, the
allocator tuning, the Prometheus metrics server (with its capped connection slots) and the provenance block every
report carries. Imports `errors`, `config_schema` and `wire` (TLS for /metrics)."""
