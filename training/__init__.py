"""Training apps: draft distillation from the target (data generation, soft targets, training, held-out eval)."""
