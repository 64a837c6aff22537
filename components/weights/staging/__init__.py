"""The staging program: stages the checkpoint into the weights root on the head node (main.py says how).

Stdlib and huggingface_hub only: shipped to the head as one zip application of these files
(`components.shipped.zipapp_text`), run there by the serving image's python3.
"""
