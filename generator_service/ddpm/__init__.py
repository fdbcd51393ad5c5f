"""Class-conditional DDPM generator (diffusers UNet2DModel): model sizes and folders, DDIM sampling, training."""
