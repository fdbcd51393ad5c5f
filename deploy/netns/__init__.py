"""Multi-host lab on this machine: network namespaces on a private bridge, a delay relay, random loss."""
