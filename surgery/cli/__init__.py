"""The Hydra application (``python -m surgery``): configs, steps, checks, reports, sweeps."""
