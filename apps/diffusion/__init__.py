"""Stable Diffusion (1.x / 2.x, SDXL) training on the Phalanx engine: text-to-image (+ LoRA), DreamBooth
(+ LoRA, SD 1.x / 2.x), sampling.

See apps/diffusion/README.md. Scripts: `python -m apps.diffusion.train_text_to_image`,
`apps.diffusion.train_text_to_image_lora`, `apps.diffusion.train_dreambooth`, `apps.diffusion.sample`,
`apps.diffusion.bench_plugins`, `apps.diffusion.build_tokenizer`.
"""
