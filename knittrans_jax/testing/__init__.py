"""Test infrastructure that scripts also use: hosts in network namespaces (netns.py)."""
