"""CuTe DSL MoE kernel drop for Hopper (sm_90a).

Self-contained: imports only torch, cutlass, cuda and the standard library, and only relative
imports inside the drop. ``moe_bf16_glu`` holds the BF16 expert computation (routing, gather,
grouped FC1 with fused activation, grouped FC2, weighted combine); ``moe_quant_glu`` the MXFP8 and
NVFP4 one (weights dequantized exactly to BF16 in shared memory, activations quantized on the device).
"""
