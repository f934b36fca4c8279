# denoising-diffusion-pytorch 2.3.4, as its README trains a model on a folder of images (sizes cut to a CPU).
import sys

from denoising_diffusion_pytorch import GaussianDiffusion, Trainer, Unet

model = Unet(dim=32, dim_mults=(1, 2, 4), channels=1, flash_attn=False)
diffusion = GaussianDiffusion(model, image_size=32, timesteps=1000, sampling_timesteps=250)
trainer = Trainer(diffusion, sys.argv[1], train_batch_size=16, train_lr=8e-5, train_num_steps=700000,
                  gradient_accumulate_every=1, ema_decay=0.995, amp=False, calculate_fid=False,
                  convert_image_to="L", save_and_sample_every=10**9, results_folder="/tmp/third/results")
trainer.train()
