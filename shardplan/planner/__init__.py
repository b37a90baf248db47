"""Planner: builds solver problems from cost tables and turns solutions into plans."""
