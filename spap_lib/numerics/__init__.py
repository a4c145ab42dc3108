"""Numerics every layer shares: Gram sums and products, linear solves, bf16 policy, channel statistics, memory."""
