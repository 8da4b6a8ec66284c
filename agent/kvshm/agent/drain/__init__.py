"""Taking a region off the node: drain events to its attached workers (written from a child
process of their own), waiting for its holders, removing its files. Stands over the region the
agent hosts and the root; imports nothing of the reconciler."""
