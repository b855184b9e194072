"""`export`: write a trained draft as a checkpoint vLLM loads."""
