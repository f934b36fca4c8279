"""fastddpm: train DDPM diffusion models at the speed of the GPU."""

__version__ = "0.1.0"
