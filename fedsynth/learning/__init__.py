"""How a model learns: datasets and their Dirichlet partitions, a client's own data folder (the label schema, the
loader and its cache, `fedsynth data split`), the models, the local training loop and FedGen's feature-space
generator. Imports `errors`, `config_schema` and `config` only (no wire, no processes)."""
