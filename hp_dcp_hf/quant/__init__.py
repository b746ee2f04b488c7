"""Quantized weights: dequantized on load (FP8 block-scaled, MXFP4, compressed-tensors), FP8 encoded on save."""
