"""The operator's read-only commands: what a deployed stack is doing, read from its outputs and its nodes.

`python -m components.status --stack NAME` (status.py) and `python -m components.logs --stack NAME NODE`
(logs.py). Both read the stack through the Automation API (stack_view.py) and change nothing.
"""
