"""Block-scaled (MXFP8, NVFP4) MoE expert computation for Hopper (sm_90a): ``kernel`` (world size 1)
and ``ep_kernel`` (expert parallel: the BF16 EP protocol of ``moe_bf16_glu`` around these GEMMs).

Hopper has no block-scaled MMA: weights travel in their format (fewer HBM bytes), are dequantized
exactly to BF16 in shared memory by the MMA warpgroups and fed to BF16 WGMMA; activations are
quantized-dequantized on the device (gather prologue, FC1 epilogue). ``weights`` needs only torch.
"""
