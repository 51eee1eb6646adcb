"""specdec-serve: an OpenAI-compatible HTTP server on the continuous-batching scheduler."""
