"""The coordinator's side of secure aggregation: one round's SecAgg+ stages, their barriers and deadlines, and the new
global model from the unmasked sum (fedsynth.secagg holds the cryptography)."""
