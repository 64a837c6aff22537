"""The simulated cluster: loopback nodes (dockerd + sshd each), an image registry and a Hugging Face hub stand-in."""
