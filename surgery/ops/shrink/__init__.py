"""Physical shrinking: shrink, rebuild and their plans."""
