"""`dsv41-exl3 discover user@host[:port] ...`: each Spark's stack config lines, read before the first up.

Issue #23, item 2: the values a new stack file needs from the nodes themselves (fabric address and interface,
HCAs, GID index, weights root) are read from the nodes rather than typed from memory. probe.sh runs on each node
(read only), parse.py reads its report, discover.py decides and prints; see discover.py for the usage.
"""
