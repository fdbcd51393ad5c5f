"""Generated protobuf and gRPC code for the fedsynth.v1 wire protocol (from proto/; do not edit by hand)."""
