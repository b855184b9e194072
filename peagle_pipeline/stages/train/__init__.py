"""`train`: train the P-EAGLE draft from caches alone (loader, trainer, checkpoints, metrics)."""
