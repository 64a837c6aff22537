"""The operator's read-only commands: what a deployed stack is doing, read from its outputs and its nodes.

`dsv41-exl3 status --stack NAME` (status.py) and `dsv41-exl3 logs --stack NAME NODE`
(logs.py). Both read the stack through the Automation API (stack_view.py) and change nothing.
"""
