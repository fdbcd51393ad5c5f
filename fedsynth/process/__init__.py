"""What every fedsynth process shares: its lifetime (signals, parent binding), atomic writes and JSON helpers, the
allocator tuning and the Prometheus metrics server. Imports `errors`, `config_schema` and `wire` (TLS for /metrics)."""
