"""Tests of kvshm.agent: the node agent."""
