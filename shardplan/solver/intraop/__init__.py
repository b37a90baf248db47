"""The intra-op problem: how every tensor of one program is sharded on one mesh.

:mod:`.problem` (the frozen, versioned problem and solution), :mod:`.problem_json` (their JSON),
:mod:`.ilp` (CP-SAT, after the LP relaxation: :mod:`.rounding` rounds a fractional optimum,
:mod:`.reduce` merges what is provably equal, :mod:`.scaling` makes coefficients integers),
:mod:`.family` (one LP per family of problems that differ in budgets only) and
:mod:`.evaluate` (the independent checker every solution is scored by). Imports nothing from jax.
"""
