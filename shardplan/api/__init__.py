"""The entry points above the planner and the runtime: ``make_plan`` and ``check_plan``
(:mod:`.planning`) and ``sp.auto`` (:mod:`.auto`), which plan and run in one call."""
