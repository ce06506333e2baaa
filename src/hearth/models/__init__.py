"""Model architectures: one file per family."""
