"""How a model learns and what it learns from: datasets and their Dirichlet partitions, a client's own folder (local
data: ImageFolder, npz or Hugging Face `datasets`, the label schema, the decoded-image cache, `fedsynth data split`),
the models (classifiers and the class-conditional UNet), the local training loop, federated evaluation's counts and
FedGen's feature-space generator. Imports `errors`, `config_schema` and `config` only (no wire, no processes)."""
