"""Measuring models: output comparison, per-layer drift, inspection."""
