"""`generate`: regenerate a dataset's replies with the target (on-policy data)."""
