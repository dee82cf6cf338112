"""The example project's tasks (``tasks.py``: the three patterns) and the observer table the demo reads."""
