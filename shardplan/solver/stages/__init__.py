"""The inter-op problem: which layers run as pipeline stages on which device group.

:mod:`.pipeline` is the contract (:class:`~.pipeline.PipelineProblem`, the plan's structure,
``check_pipeline`` and ``evaluate_pipeline``); :mod:`.search` the stage planner (its replica
:mod:`.shapes`, their :mod:`.mix`, the fluid :mod:`.bound`, the :mod:`.quick` first plan,
:mod:`.uniform` stacks of identical layers, the two-type replicas of :mod:`.pairs`, and the
report of a problem with no plan, :mod:`.infeasible`); :mod:`.baselines` the data-parallel and
Megatron-style plans (scored in closed form by :mod:`.runs`); :mod:`.portfolio` runs the search
seeded with them; :mod:`.simulate` plays a plan out task by task. Imports nothing from jax.
"""
