"""The dropless mixture-of-experts: router, token dispatch, grouped matmul, the MoE block."""
