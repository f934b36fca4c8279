from fastddpm.models.attention import set_attention_head_pad
from fastddpm.models.ddpm_unet import DDPMUNet
from fastddpm.models.unet import UNet, count_parameters, sinusoidal_time_embedding

__all__ = ["UNet", "DDPMUNet", "build_unet", "count_parameters", "set_attention_head_pad",
           "sinusoidal_time_embedding"]


def build_unet(cfg):
    """The U-Net of model.family: the seed's (UNet) or the DDPM / improved-diffusion one (DDPMUNet)."""
    return DDPMUNet(cfg) if cfg.family == "ddpm" else UNet(cfg)
