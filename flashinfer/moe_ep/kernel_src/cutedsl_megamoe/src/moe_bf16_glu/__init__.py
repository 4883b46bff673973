"""BF16 MoE expert computation for Hopper (sm_90a), world size 1.

Kernel modules import cutlass; ``weights``, ``reference`` and ``common.host_utils`` need only
torch, so a runtime without cutlass can still prepare weights and size workspaces.
"""
