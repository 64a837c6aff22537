"""Observability: Prometheus on the head, the program's exporter on every node, alert rules and a dashboard.

The exporter's modules (metrics.py, exporter.py) run inside the serving image and import the stdlib and
prometheus_client only; this package's __init__ imports nothing.
"""
