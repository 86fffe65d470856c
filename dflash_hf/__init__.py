"""DFlash block-diffusion drafters for lossless speculative decoding with Hugging Face transformers."""
