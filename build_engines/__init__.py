"""Checkpoint loading and engine compilation."""
