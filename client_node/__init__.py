"""The client-node process: private shard, local training, the budget policy and the synthetic-image cache."""
