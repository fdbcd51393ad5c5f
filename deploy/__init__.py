"""Launching fedsynth: the local multi-process launcher, experiments, reports, TLS provisioning and templates."""
