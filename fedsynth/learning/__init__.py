"""How a model learns: datasets and their Dirichlet partitions, the models, the local training loop and FedGen's
feature-space generator. Imports `errors`, `config_schema` and `config` only (no wire, no processes)."""
