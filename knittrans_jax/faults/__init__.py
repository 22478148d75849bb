"""Fault injection: scenarios that break the pipeline on purpose and count what
survives (tests/faults/, scripts/fault_report.py)."""
