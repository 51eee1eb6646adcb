"""specdec-bench: speculative decoding measured side by side with plain decoding and transformers."""
