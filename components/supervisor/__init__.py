"""The supervisor layer: the agents that keep the group serving between updates (agent.py, policy.py), their
wiring (supervisor.py), the update lock the program holds (update_lock.py) and the operator's CLI
(`dsv41-exl3 supervisor status|pause|resume --stack NAME`)."""
