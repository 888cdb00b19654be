"""Model math and files: GGUF reading, kernels, forward pass, tokenizers, sampling. No network."""
