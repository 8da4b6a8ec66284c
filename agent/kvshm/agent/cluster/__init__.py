"""Cluster mode: regions from the Kubernetes API, status back into it (no kopf: see DESIGN)."""
