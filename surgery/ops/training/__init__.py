"""Recovery: fine-tuning and distillation."""
