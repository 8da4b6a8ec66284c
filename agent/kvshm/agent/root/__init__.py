"""The region root on a hostile filesystem: its tmpfs and pages, its directories walked by
descriptor, a region's files in them and who holds those, and the room and descriptors a new
region may take. Imports nothing of the agent above it."""
