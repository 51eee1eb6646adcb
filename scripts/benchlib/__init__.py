"""Helpers the scripts share (replays, load generation, an OpenAI client, step timing); not installed."""
