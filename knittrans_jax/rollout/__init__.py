"""Rollout: the KV-cache sampler, synthetic tasks, workers and weight sync."""
