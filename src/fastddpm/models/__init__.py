from fastddpm.models.unet import UNet, count_parameters, sinusoidal_time_embedding

__all__ = ["UNet", "count_parameters", "sinusoidal_time_embedding"]
