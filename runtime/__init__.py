"""Engines that execute a model with its own KV cache (the Engine protocol)."""
