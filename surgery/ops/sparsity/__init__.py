"""Pruning: the verb, its criteria and OWL's sparsity allocation."""
