"""Pruning: the verb, its criteria and OWL plans."""
