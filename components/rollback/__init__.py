"""Rollback to the last verified deployment: the pure choice of update and config (`history.py`) and the
command that restores it and runs `up` (`rollback.py`, `dsv41-exl3 rollback`)."""
