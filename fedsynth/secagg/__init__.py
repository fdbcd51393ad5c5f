"""SecAgg+ (Bell et al., CCS 2020) without the network: key agreement, Shamir sharing, masks and the four stages of one
round, as plain functions the coordinator and the client nodes call. Imports only fedsynth.errors."""
