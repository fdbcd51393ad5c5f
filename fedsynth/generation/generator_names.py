"""Names other processes use to reach and read the generator service: its gRPC service, model folder and metrics."""

from __future__ import annotations

from fedsynth.v1 import generator_pb2

SERVICE_NAME = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name  # for grpc.health.v1
METADATA_FILE = "fedsynth_generator.json"  # written last by `fedsynth generator train`: it marks a whole model folder

# Samples of `fedsynth generator serve`'s /metrics that the launcher copies into report.json.
IMAGES_TOTAL = "fedsynth_generator_images_total"  # counter, by class_id
DEVICE_SECONDS_TOTAL = "fedsynth_generator_device_seconds_total"  # counter: time spent sampling
REQUESTS_TOTAL = "fedsynth_generator_requests_total"  # counter, by method and code
# The quality filter (--min-confidence): candidates drawn, accepted and rejected by the judge, by class_id; what it cost.
FILTER_MIN_CONFIDENCE = "fedsynth_generator_filter_min_confidence"  # gauge: 0 = no filter
FILTER_CANDIDATES_TOTAL = "fedsynth_generator_filter_candidates_total"
FILTER_ACCEPTED_TOTAL = "fedsynth_generator_filter_accepted_total"
FILTER_REJECTED_TOTAL = "fedsynth_generator_filter_rejected_total"
FILTER_UNSERVED_DEVICE_SECONDS_TOTAL = "fedsynth_generator_filter_unserved_device_seconds_total"
FILTER_JUDGE_SECONDS_TOTAL = "fedsynth_generator_filter_judge_seconds_total"
INFO = "fedsynth_generator_info"  # labels: backend, size, model_id, device, dtype
# A generator folder trained on public data only says so here ({"public_data": ..., "relation_to_clients": ...}):
# `generator train` copies it from its --data-dir; `generator evolve` refuses a --public-model without it.
PUBLIC_FILE = "public.json"
