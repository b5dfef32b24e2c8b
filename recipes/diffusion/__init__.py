"""The `diffusion` recipe: a class-conditional flow-matching denoiser for the 8 x 8 handwritten digits."""
