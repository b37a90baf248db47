"""The plan's views: the terminal view (``shardplan show``), a self-contained HTML report, the
text report (``plan.report()``) and ``plan.explain()``; the ones the Plan methods render are
registered in :data:`shardplan.plan.plan.VIEWS` when their module is imported."""
