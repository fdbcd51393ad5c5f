"""`fedsynth plan`: the allocation planner's command and its figures. Imports `allocation`, `learning` (labels and
partitions), `config`, `config_schema` and `errors`."""
