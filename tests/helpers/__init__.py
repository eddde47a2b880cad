"""Test helpers: multi-process gloo runner and Megatron MoE layer harness."""
