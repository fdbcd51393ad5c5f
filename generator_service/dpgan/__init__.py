"""Differentially private WGAN-GP (noise on the critic's per-sample gradients) that SDA-FL clients train locally."""

from generator_service.dpgan.config import DPGANConfig
from generator_service.dpgan.train import DPGANResult, TrainProgress, sample_images, train_dp_wgan

__all__ = ["DPGANConfig", "DPGANResult", "TrainProgress", "sample_images", "train_dp_wgan"]
