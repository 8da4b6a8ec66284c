"""What a job is, before any GPU touches it: vLLM's specs, the checks of a handler's tensors,
and a job planned into copies (the general planner, uniform jobs from their ids alone, staged
pieces). numpy and torch's CPU side only."""
