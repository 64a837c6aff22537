"""`python -m components.logs --stack NAME NODE [--follow]`: a rank's docker logs (components/operator/logs.py)."""
