"""The generator process: class-conditional DDPM served over gRPC, generator training, and the DP-GAN used by SDA-FL."""
