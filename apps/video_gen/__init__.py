"""Open-Sora-style text-to-video on phalanx: a 3D-RoPE diffusion transformer (diffusers' Wan) trained
with rectified flow on (frames, height, width) buckets, a causal 3D autoencoder (diffusers'
AutoencoderKLWan), Ulysses sequence parallelism over video tokens. See README.md."""
