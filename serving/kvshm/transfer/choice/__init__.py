"""Which copy backend takes a handler's job: the per-job policy by block size and direction,
the route of a job (uniform or through the planner), and the other direction's traffic."""
