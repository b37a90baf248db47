"""Code the tests share: train steps written as users write them, hand-built plans and
problems, brute forces and process helpers. ``tests/`` is on ``sys.path`` (pytest's
``pythonpath``), so tests import ``helpers.<module>``."""
