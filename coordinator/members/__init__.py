"""Members the coordinator need not trust: what it refuses of a client (its update, its registration), who pays for
it (that client, never the run) and the record of both (report.json refused_updates, excluded_clients)."""
