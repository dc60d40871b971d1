"""Training the pruned model back towards the original: recovery distillation on transformers'
`Trainer` (`distill`)."""
