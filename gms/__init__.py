"""gms: a GPU Memory Service."""
