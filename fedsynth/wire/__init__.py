"""How bytes travel: the tensor codec and its buffers, chunked streams, the raw-TCP data plane, strict decoding, the
wire dtype of updates, gRPC channel/server helpers and mutual TLS. Imports only `errors`, `config_schema` and the
generated `v1` code: everything above may use it, it uses nothing above."""
