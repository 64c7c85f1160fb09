"""Building a model under surgery: ``intercept`` swaps or wraps modules while a third-party constructor runs, by ``rules``."""
