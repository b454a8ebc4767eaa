"""Drafter training: data, self-distillation, features, loss and the DeepSpeed entry point."""
