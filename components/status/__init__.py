"""`python -m components.status --stack NAME [--json]`: the stack's health at a glance (operator/status.py)."""
