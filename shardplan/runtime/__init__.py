"""Runtime: executes plans (one SPMD program per stage)."""
