"""Attention over a shared prefix: the merged and varlen two-part kernels, the CUDA kernels' checks and their
preflight, the attention keywords HF hands an attention function, sliding windows and attention chunks, and
absolute positions."""
