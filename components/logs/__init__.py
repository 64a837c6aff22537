"""`python -m components.logs`, kept for one release: now `dsv41-exl3 logs` (components/operator/logs.py)."""
