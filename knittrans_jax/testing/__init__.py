"""Helpers that tests, benchmarks, fault reports and scripts share: a local S3 server
(s3_server.py), a link-cutting proxy (cut_proxy.py) and hosts in network namespaces
(netns.py)."""
