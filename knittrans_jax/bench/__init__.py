"""The benchmarks' shared library: scripts/bench_*.py and scripts/device_bench.py are
front ends (flags, printing, the JSON) over these modules."""
