"""Synthetic-data allocation: FedEAS budgets, matched baselines, the policy dispatch, imbalance and budget paths."""

from fedsynth.allocation.baselines import full_balance, matched_quota, missing_only_quota, spread_evenly, uniform_quota
from fedsynth.allocation.entropy import normalized_entropies, normalized_entropy
from fedsynth.allocation.fedeas import (
    PAPER_EXPONENT,
    fedeas_budgets,
    fedeas_client_budget,
    fedeas_generation,
    fedeas_generation_row,
)
from fedsynth.allocation.imbalance import (
    WEIGHTINGS,
    ImbalanceDecomposition,
    client_imbalance,
    first_order_gain,
    imbalance_decomposition,
    imbalance_removed,
    imbalance_score,
    synthetic_fraction,
)
from fedsynth.allocation.paths import (
    DEFAULT_BETAS,
    MAX_SYNTHETIC,
    MIN_REMOVED,
    BetaPoint,
    GreedyPath,
    beta_path,
    greedy_path,
    matched_path,
    select_beta,
)
from fedsynth.allocation.policies import assigned_quota, client_quota, generation_matrix
from fedsynth.allocation.validation import (
    MATCHED_POLICIES,
    POLICIES,
    validate_beta,
    validate_budget,
    validate_counts,
    validate_counts_row,
    validate_policy,
)

__all__ = [
    "DEFAULT_BETAS",
    "MATCHED_POLICIES",
    "MAX_SYNTHETIC",
    "MIN_REMOVED",
    "PAPER_EXPONENT",
    "POLICIES",
    "WEIGHTINGS",
    "BetaPoint",
    "GreedyPath",
    "ImbalanceDecomposition",
    "assigned_quota",
    "beta_path",
    "client_imbalance",
    "client_quota",
    "fedeas_budgets",
    "fedeas_client_budget",
    "fedeas_generation",
    "fedeas_generation_row",
    "first_order_gain",
    "full_balance",
    "generation_matrix",
    "greedy_path",
    "imbalance_decomposition",
    "imbalance_removed",
    "imbalance_score",
    "matched_path",
    "matched_quota",
    "missing_only_quota",
    "normalized_entropies",
    "normalized_entropy",
    "select_beta",
    "spread_evenly",
    "synthetic_fraction",
    "uniform_quota",
    "validate_beta",
    "validate_budget",
    "validate_counts",
    "validate_counts_row",
    "validate_policy",
]
