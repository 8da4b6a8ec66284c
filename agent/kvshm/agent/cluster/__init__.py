"""Cluster mode: regions from the Kubernetes API, status back into it (no kopf:
the agent only lists, watches and patches)."""
