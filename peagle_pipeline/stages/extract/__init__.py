"""`extract`: run the target once over a dataset and write the cache (hidden states, top-k log-probs, loss masks)."""
