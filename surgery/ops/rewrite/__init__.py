"""Input rewriting."""
