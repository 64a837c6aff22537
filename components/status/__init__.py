"""`python -m components.status`, kept for one release: now `dsv41-exl3 status` (components/operator/status.py)."""
